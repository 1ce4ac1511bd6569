"""Phi-3 / Phi-4-mini (models/phi3.py) against transformers on a tiny random model saved as a Hugging Face folder.

Switched on: fused qkv_proj and gate_up_proj (as the checkpoints store them), partial rotary (0.75 of each head
turns, as in Phi-4-mini), LongRoPE short/long factors with an attention factor (max positions 4x the original 32),
and a sliding window (12) shorter than the prompts. Logits within 1e-3 relative error and equal greedy
continuations inside the original context; past it, the long factors and attention factor must give transformers'
cos/sin (transformers applies them to a whole sequence once it outgrows the original context, tokenriver per
position: see models/phi3.py).
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

ORIGINAL = 32
ROTARY_DIM = 12  # 0.75 of head_dim 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    generator = torch.Generator().manual_seed(0)
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": (1 + torch.rand(ROTARY_DIM // 2, generator=generator)).tolist(),
        "long_factor": (1 + 4 * torch.rand(ROTARY_DIM // 2, generator=generator)).tolist(),
    }
    config = transformers.Phi3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * ORIGINAL,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters=rope,
        sliding_window=12,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    reference = widen(transformers.Phi3ForCausalLM(config), seed=7)
    folder = tmp_path_factory.mktemp("phi3")
    reference.save_pretrained(folder, safe_serialization=True)
    return reference, load_folder(str(folder))


def test_config(pair):
    _, ours = pair
    config = ours.config
    assert config.architecture == "phi3" and config.rotary_dim == ROTARY_DIM
    assert config.rope_scaling["rope_type"] == "longrope" and config.rope_scaling["attention_factor"] > 1
    assert config.layer_window(0) == 12


@pytest.mark.parametrize("length", [5, 30])
def test_logits_match_transformers(pair, length):
    reference, ours = pair
    ids = random_ids(length, 256, seed=length)
    want, got = transformers_logits(reference, ids), run_one(ours, ids)
    assert relative_error(got, want) < 1e-3, relative_error(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_greedy_continuation_equals_transformers(pair):
    reference, ours = pair
    ids = random_ids(10, 256, seed=1)
    assert greedy_ours(ours, ids, ORIGINAL - 10) == greedy_transformers(reference, ids, ORIGINAL - 10)


def test_long_factors_past_the_original_context(pair):
    reference, ours = pair
    positions = torch.arange(ORIGINAL, 3 * ORIGINAL)
    want_cos, want_sin = reference.model.rotary_emb(torch.zeros(1), positions[None])  # [1, T, rotary_dim]
    got_cos, got_sin = ours.model.rotary_emb(positions, torch.float32)  # [T, 1, rotary_dim // 2]
    half = ROTARY_DIM // 2
    assert torch.allclose(got_cos[:, 0], want_cos[0, :, :half], atol=1e-6)
    assert torch.allclose(got_sin[:, 0], want_sin[0, :, :half], atol=1e-6)


def test_batch_and_chunking_do_not_change_a_request(pair):
    _, ours = pair
    first, second = random_ids(21, 256, seed=2), random_ids(40, 256, seed=3)
    alone = [run_one(ours, first), run_one(ours, second)]
    mixed = run_steps(ours, [first, second], [[11, 17], [10, 23]])
    for got, want in zip(mixed, alone):
        assert torch.allclose(got, want, rtol=0, atol=1e-4), (got - want).abs().max()
