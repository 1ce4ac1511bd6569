"""Every registered page keeps models/contract.py's Protocols: what the runner, the loader and the draft models read.

A page is built tiny on the meta device (no weights), checked with the runtime Protocols, and its methods' parameter
names compared with the Protocols' (the runner passes them by position, so a renamed or reordered parameter would be
a different contract).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tokenriver.models.config import ModelConfig
from tokenriver.models.contract import CausalLM, DecoderStack, ModelPage, PoolingModel
from tokenriver.models.registry import ARCHITECTURES
from tokenriver.runner.native_stack import NATIVE_LAYOUTS

ENCODERS = {"bert", "nomic-bert", "xlm-roberta"}
MIXTURES = {"qwen3_moe", "mixtral", "qwen2_moe"}


def tiny_config(architecture: str) -> ModelConfig:
    extra: dict = {}
    if architecture in MIXTURES:
        extra = {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 8}
    if architecture in ENCODERS:
        extra = {"is_causal": False, "num_labels": 1, "type_vocab_size": 2, "hidden_act": "gelu"}
    return ModelConfig(
        architecture=architecture,
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        **extra,
    )


def build(architecture: str) -> torch.nn.Module:
    with torch.device("meta"):
        return ARCHITECTURES[architecture](tiny_config(architecture))


def parameter_names(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_every_page_is_a_model_page(architecture):
    page = build(architecture)
    assert isinstance(page, ModelPage)
    assert parameter_names(type(page).forward) == parameter_names(ModelPage.__call__)
    assert page.config.architecture == architecture
    assert all(isinstance(parts, tuple) for parts in page.fused_projections.values())


@pytest.mark.parametrize("architecture", sorted(set(ARCHITECTURES) - ENCODERS))
def test_a_decoder_page_is_a_causal_lm_with_a_decoder_stack(architecture):
    page = build(architecture)
    assert isinstance(page, CausalLM) and not isinstance(page, PoolingModel)
    assert isinstance(page.model, DecoderStack) and isinstance(page.model.layers, torch.nn.ModuleList)
    assert parameter_names(type(page).compute_logits) == parameter_names(CausalLM.compute_logits)
    for name in ("embed", "run_layers", "final_norm"):
        assert parameter_names(getattr(type(page.model), name)) == parameter_names(getattr(DecoderStack, name))
    assert page.layer_layout in NATIVE_LAYOUTS


@pytest.mark.parametrize("architecture", sorted(ENCODERS))
def test_an_encoder_page_is_a_pooling_model_with_no_native_layout(architecture):
    page = build(architecture)
    assert isinstance(page, PoolingModel) and not isinstance(page, CausalLM)
    assert parameter_names(type(page).score) == parameter_names(PoolingModel.score)
    assert page.layer_layout is None


def test_a_module_missing_a_part_is_no_page():
    class Headless(torch.nn.Module):
        config = tiny_config("llama")
        fused_projections: dict = {}

    assert not isinstance(Headless(), ModelPage)  # no layer_layout
    Headless.layer_layout = None
    assert isinstance(Headless(), ModelPage) and not isinstance(Headless(), CausalLM)
