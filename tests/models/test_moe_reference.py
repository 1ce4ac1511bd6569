"""Mixture-of-experts (models/moe.py): Qwen3-MoE, Mixtral and Qwen2-MoE against transformers on tiny random
models.

Eight experts, two per token, with and without renormalized top-k weights (Qwen3-MoE's norm_topk_prob; Mixtral
always renormalizes), and Qwen2-MoE's gated shared expert with its QKV bias. Logits within 1e-3 relative error
(float32, no quantization), equal greedy continuations, and a request independent of its batch and chunking
although the experts see other rows. Each expert must multiply only the rows routed to it: counted through a hook
on the experts' first projection.
"""

from __future__ import annotations

import pytest
import torch
from arch_reference import (
    greedy_ours,
    greedy_transformers,
    load_folder,
    random_ids,
    relative_error,
    run_one,
    run_steps,
    transformers_logits,
    widen,
)

transformers = pytest.importorskip("transformers")

SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    num_experts_per_tok=2,
)


def tiny(kind: str):
    if kind == "mixtral":
        config = transformers.MixtralConfig(**SIZES, num_local_experts=8)
        return widen(transformers.MixtralForCausalLM(config), seed=5)
    if kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **SIZES, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False
        )
        return widen(transformers.Qwen2MoeForCausalLM(config), seed=7)
    config = transformers.Qwen3MoeConfig(
        **SIZES, num_experts=8, moe_intermediate_size=32, norm_topk_prob=kind == "qwen3_moe_norm"
    )
    return widen(transformers.Qwen3MoeForCausalLM(config), seed=6)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_moe_norm", "mixtral", "qwen2_moe"])
def pair(request, tmp_path_factory):
    reference = tiny(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(folder, safe_serialization=True)
    return reference, load_folder(str(folder))


def test_config(pair):
    reference, ours = pair
    config = ours.config
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    assert config.norm_topk_prob == (reference.config.model_type == "mixtral" or reference.config.norm_topk_prob)
    assert config.shared_expert_intermediate_size == getattr(reference.config, "shared_expert_intermediate_size", 0)


@pytest.mark.parametrize("length", [9, 50])
def test_logits_match_transformers(pair, length):
    reference, ours = pair
    ids = random_ids(length, 256, seed=length)
    want, got = transformers_logits(reference, ids), run_one(ours, ids)
    assert relative_error(got, want) < 1e-3, relative_error(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_greedy_continuation_equals_transformers(pair):
    reference, ours = pair
    ids = random_ids(10, 256, seed=1)
    assert greedy_ours(ours, ids, 12) == greedy_transformers(reference, ids, 12)


def test_batch_and_chunking_do_not_change_a_request(pair):
    _, ours = pair
    first, second = random_ids(21, 256, seed=2), random_ids(40, 256, seed=3)
    alone = [run_one(ours, first), run_one(ours, second)]
    mixed = run_steps(ours, [first, second], [[11, 17], [10, 23]])
    for got, want in zip(mixed, alone):
        assert torch.allclose(got, want, rtol=0, atol=1e-4), (got - want).abs().max()


def test_each_expert_multiplies_only_its_tokens(pair):
    _, ours = pair
    block = ours.model.layers[0].mlp
    rows_seen = []
    hooks = [
        expert.gate_up_proj.register_forward_hook(lambda module, args, out: rows_seen.append(args[0].shape[0]))
        for expert in block.experts
    ]
    try:
        ids = random_ids(30, 256, seed=7)
        run_one(ours, ids)
    finally:
        for hook in hooks:
            hook.remove()
    # 30 tokens, 2 experts each: 60 rows in all over the experts that were chosen, none computed twice.
    assert sum(rows_seen) == 30 * 2 and len(rows_seen) <= 8
