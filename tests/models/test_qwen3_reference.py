"""Qwen3 (models/qwen3.py) against transformers on a tiny random model saved as a Hugging Face folder.

Qwen3's feature over Llama is the per-head RMSNorm of queries and keys before rotary (q_norm, k_norm), switched
on here with widened weights so that a missing or misplaced norm shows. Logits within 1e-3 relative error (float32,
no quantization), equal greedy continuations, and a request independent of its batch and chunking.
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
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    reference = widen(
        transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZES, tie_word_embeddings=True)), seed=3
    )
    folder = tmp_path_factory.mktemp("qwen3")
    reference.save_pretrained(folder, safe_serialization=True)
    return reference, load_folder(str(folder))


def test_config(pair):
    _, ours = pair
    assert ours.config.architecture == "qwen3" and ours.config.qk_norm and ours.config.tie_word_embeddings


@pytest.mark.parametrize("length", [7, 60])
def test_logits_match_transformers(pair, length):
    reference, ours = pair
    ids = random_ids(length, 256, seed=length)
    want, got = transformers_logits(reference, ids), run_one(ours, ids)
    assert relative_error(got, want) < 1e-3, relative_error(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_greedy_continuation_equals_transformers(pair):
    reference, ours = pair
    ids = random_ids(12, 256, seed=1)
    assert greedy_ours(ours, ids, 16) == greedy_transformers(reference, ids, 16)


def test_batch_and_chunking_do_not_change_a_request(pair):
    _, ours = pair
    first, second = random_ids(21, 256, seed=2), random_ids(40, 256, seed=3)
    alone = [run_one(ours, first), run_one(ours, second)]
    mixed = run_steps(ours, [first, second], [[11, 17], [10, 23]])
    for got, want in zip(mixed, alone):
        assert torch.allclose(got, want, rtol=0, atol=1e-4), (got - want).abs().max()
