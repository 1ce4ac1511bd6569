"""The newer architectures from GGUF files written as llama.cpp's converter writes them (tests/models/gguf_convert.py)
against transformers on the same tiny random models.

Gemma 3 (q/k norms, 1 + w norms, per-layer sliding pattern and local rope base, linear scaling of global layers),
Gemma 2 (soft-capping), Qwen3, Phi-3 (fused tensors, partial rotary, LongRoPE factor tensors), Qwen3-MoE,
Mixtral (a "llama" file with stacked experts and permuted q/k rows) and Qwen2-MoE (a shared expert, its gate
stored as a vector). Logits within 1e-3 relative error with quantization "none". Experts stored as Q8_0 stay packed
per expert with quantization "auto" and give the logits of the same file dequantized.
"""

from __future__ import annotations

import pytest
import torch
from arch_reference import random_ids, relative_error, run_one, transformers_logits, widen
from gguf_convert import GEMMA_SPECIALS, Q, write_gguf

from tokenriver.errors import InvalidParameterError
from tokenriver.loader.assemble import build_model
from tokenriver.loader.gguf import read_gguf
from tokenriver.loader.load import load_model
from tokenriver.models.quant import Int8Linear

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def tiny(kind: str):
    if kind == "gemma3":
        config = transformers.Gemma3TextConfig(
            **COMMON,
            intermediate_size=128,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        )
        return widen(transformers.Gemma3ForCausalLM(config), 1, norm_range=(-0.5, 0.5)), "gemma3"
    if kind == "gemma2":
        config = transformers.Gemma2Config(
            **COMMON,
            intermediate_size=128,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=8,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        )
        model = transformers.Gemma2ForCausalLM(config)
        model.config._attn_implementation = "eager"
        return widen(model, 2, norm_range=(-0.5, 0.5)), "gemma2"
    if kind == "qwen3":
        return widen(
            transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, intermediate_size=128, head_dim=32)), 3
        ), "qwen3"
    if kind == "phi3":
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
        }
        config = transformers.Phi3Config(
            **{**COMMON, "max_position_embeddings": 128},
            intermediate_size=128,
            original_max_position_embeddings=32,
            rope_parameters=rope,
            pad_token_id=0,
        )
        return widen(transformers.Phi3ForCausalLM(config), 4), "phi3"
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **COMMON,
            intermediate_size=128,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        )
        return widen(transformers.Qwen3MoeForCausalLM(config), 5), "qwen3moe"
    if kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **COMMON,
            intermediate_size=128,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
        )
        return widen(transformers.Qwen2MoeForCausalLM(config), 8), "qwen2moe"
    config = transformers.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    return widen(transformers.MixtralForCausalLM(config), 6), "llama"


def load(path: str, quantization: str = "none"):
    checkpoint = read_gguf(path, keep_quantized=quantization != "none")
    return build_model(checkpoint.config, checkpoint.weights, "cpu", path, quantization)


@pytest.mark.parametrize("kind", ["gemma3", "gemma2", "qwen3", "phi3", "qwen3_moe", "mixtral", "qwen2_moe"])
def test_gguf_logits_match_transformers(tmp_path, kind):
    reference, arch = tiny(kind)
    reference.save_pretrained(tmp_path / "hf", safe_serialization=True)
    path = str(tmp_path / "model.gguf")
    write_gguf(str(tmp_path / "hf"), arch, path)
    ours = load(path)
    assert ours.config.architecture == kind
    ids = random_ids(30, 256, seed=9)
    want, got = transformers_logits(reference, ids), run_one(ours, ids)
    assert relative_error(got, want) < 1e-3, relative_error(got, want)


def test_packed_experts_from_a_q8_0_file(tmp_path):
    reference, arch = tiny("qwen3_moe")
    reference.save_pretrained(tmp_path / "hf", safe_serialization=True)
    path = str(tmp_path / "model.gguf")
    write_gguf(str(tmp_path / "hf"), arch, path, expert_type=Q.Q8_0)
    packed, dequantized = load(path, "auto"), load(path, "none")
    experts = packed.model.layers[0].mlp.experts
    assert all(isinstance(e.gate_up_proj, Int8Linear) and isinstance(e.down_proj, Int8Linear) for e in experts)
    ids = random_ids(30, 256, seed=10)
    got, want = run_one(packed, ids), run_one(dequantized, ids)
    assert relative_error(got, want) < 1e-5, relative_error(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_gemma_file_without_a_chat_template_gets_gemmas(tmp_path):
    """A Gemma GGUF whose converter wrote no chat template (as the shipped Gemma 3 270M file): load_model gives the
    tokenizer Gemma's template, rendering the turns transformers renders, and <end_of_turn> ends generation."""
    reference, arch = tiny("gemma3")
    reference.save_pretrained(tmp_path / "hf", safe_serialization=True)
    path = str(tmp_path / "model.gguf")
    write_gguf(str(tmp_path / "hf"), arch, path, with_vocabulary=True)
    tokenizer = load_model(path, quantization="none").tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )
    with pytest.raises(InvalidParameterError, match="alternate"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "Hi"}])
    end_of_turn = GEMMA_SPECIALS.index("<end_of_turn>")
    assert set(tokenizer.eos_token_ids) == {1, end_of_turn}
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    assert ids[:2] == [2, GEMMA_SPECIALS.index("<start_of_turn>")] and tokenizer.decode(ids[2:]).startswith("user\nHi")
