"""Gemma 2 and Gemma 3 (models/gemma.py) against transformers on tiny random models saved as Hugging Face folders.

Every Gemma feature is switched on: (1 + weight) norms on both sides of each block, the scaled embedding, GeGLU,
query_pre_attn_scalar, sliding-window layers with a window (8) much shorter than the prompts, Gemma 3's q/k norms
and per-layer-type rope (its own base for sliding layers, linear scaling on global ones), Gemma 2's attention and
final-logit soft-capping. Logits must match within 1e-3 relative error (float32, no quantization), greedy
continuations must be equal, a request must not depend on its batch or chunking, and a prefix-cache hit that
ends past a window boundary must give the logits of computing the whole prompt.
"""

from __future__ import annotations

import pytest
import torch
from arch_reference import (
    BLOCK_SIZE,
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

from tokenriver.kv.cache import KVCache
from tokenriver.loader.assemble import build_model

transformers = pytest.importorskip("transformers")

WINDOW = 8
SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    query_pre_attn_scalar=24,
    sliding_window=WINDOW,
)


def tiny_gemma(kind: str):
    if kind == "gemma3":
        config = transformers.Gemma3TextConfig(
            **SIZES,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        )
        model = transformers.Gemma3ForCausalLM(config)
    else:
        config = transformers.Gemma2Config(**SIZES, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
        model = transformers.Gemma2ForCausalLM(config)
    model.config._attn_implementation = "eager"
    # Gemma norms multiply by (1 + weight): weights around zero.
    return widen(model, seed=len(kind), norm_range=(-0.5, 0.5))


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def pair(request, tmp_path_factory):
    """(transformers model, tokenriver model loaded from its saved folder)."""
    reference = tiny_gemma(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(folder, safe_serialization=True)
    return reference, load_folder(str(folder))


def test_config_maps_every_feature(pair):
    reference, ours = pair
    config = ours.config
    assert config.architecture == reference.config.model_type.removesuffix("_text")
    assert config.layer_types == tuple(reference.config.layer_types)
    assert config.sliding_window == WINDOW and config.query_pre_attn_scalar == 24
    assert config.hidden_act == "gelu_pytorch_tanh" and config.tie_word_embeddings
    if config.architecture == "gemma3":
        assert config.qk_norm and config.rope_local_base_freq == 100.0
        assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    else:
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (5.0, 3.0)


@pytest.mark.parametrize("length", [5, 40, 70])
def test_logits_match_transformers(pair, length):
    reference, ours = pair
    ids = random_ids(length, 256, seed=length)
    want = transformers_logits(reference, ids)
    got = run_one(ours, ids)
    assert relative_error(got, want) < 1e-3, relative_error(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_greedy_continuation_equals_transformers(pair):
    reference, ours = pair
    ids = random_ids(20, 256, seed=1)
    assert greedy_ours(ours, ids, 16) == greedy_transformers(reference, ids, 16)


def test_batch_and_chunking_do_not_change_a_request(pair):
    _, ours = pair
    first, second = random_ids(37, 256, seed=2), random_ids(50, 256, seed=3)
    alone = [run_one(ours, first), run_one(ours, second)]
    # One step together; then prefill chunks of 13 and 9 tokens and single-token decodes beside a long prefill.
    together = run_steps(ours, [first, second], [[37, 50]])
    mixed = run_steps(ours, [first, second], [[13, 20], [9, 30]] + [[1, 0]] * 15)
    for batched in (together, mixed):
        for got, want in zip(batched, alone):
            assert torch.allclose(got, want, rtol=0, atol=1e-4), (got - want).abs().max()


def test_prefix_cache_hit_across_the_window_boundary(pair):
    _, ours = pair
    shared = random_ids(2 * BLOCK_SIZE, 256, seed=4)  # two full blocks, far longer than the window
    first, second = shared + random_ids(10, 256, seed=5), shared + random_ids(25, 256, seed=6)
    whole = run_one(ours, second)
    # The first request fills blocks 0-2; the second names blocks 0 and 1 (its cached prefix) and computes the rest.
    tables = [[0, 1, 2], [0, 1, 3, 4]]
    config = ours.config
    cache = KVCache(config.num_layers, 5, BLOCK_SIZE, config.num_kv_heads, config.head_dim, torch.float32)
    run_steps(ours, [first, second], [[len(first), 0]], tables=tables, cache=cache)
    hit = run_steps(
        ours, [first, second], [[0, 9], [0, 16]], tables=tables, cache=cache, start=[len(first), len(shared)]
    )[1]
    assert torch.allclose(hit, whole[len(shared) :], rtol=0, atol=1e-4), (hit - whole[len(shared) :]).abs().max()


def test_bfloat16_greedy_agrees_with_float32(pair):
    reference, ours = pair
    weights = {name: tensor.to(torch.bfloat16) for name, tensor in ours.state_dict().items()}
    model = build_model(ours.config, weights, "cpu", dtype=torch.bfloat16)
    ids = random_ids(60, 256, seed=8)
    got = run_one(model, ids)
    assert got.dtype == torch.float32
    agreement = (got.argmax(-1) == transformers_logits(reference, ids).argmax(-1)).float().mean().item()
    assert agreement >= 0.9, agreement
