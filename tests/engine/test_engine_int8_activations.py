"""int8_activations: every quantized layer rounds decode activations to int8, as llama.cpp does, and those of larger
products where the CPU has the instructions.

The setting is chosen at load time and must reach every 4-bit layer and the one-call native decoder; the greedy
continuation follows the exact engine's for a while, its log-probabilities close to the exact ones; a setting
that would have no effect is refused, not ignored.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tokenriver.config import EngineConfig
from tokenriver.engine.llm import LLM
from tokenriver.errors import InvalidParameterError
from tokenriver.loader.load import load_model
from tokenriver.models.cpu.kernels import load_kernels
from tokenriver.models.quant import Int4Linear, Int8Linear
from tokenriver.params import SamplingParams

TEXT = Path(__file__).resolve().parents[1] / "data" / "perplexity_text.md"
PROMPTS = ["The capital of France is", "Write a haiku about rivers:", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def loaded_int8_activations(default_model_path):
    return load_model(default_model_path, quantization="auto", int8_activations=True)


def test_every_quantized_layer_rounds_the_int8_output_layer_included(loaded_int8_activations):
    model = loaded_int8_activations.model
    int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
    int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert int4 and all(m.int8_activations for m in int4)
    assert model.lm_head in int8 and all(m.int8_activations for m in int8)
    expected = None if load_kernels() is None else "int8"  # many rows round as one does, on every CPU
    assert all(m.gemm_rounding == expected for m in int4 + int8)
    assert loaded_int8_activations.int8_activations


def test_greedy_follows_the_exact_engine(loaded_packed, loaded_int8_activations):
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1)
    exact = LLM.from_loaded(loaded_packed).generate(PROMPTS, params, use_tqdm=False)
    engine = LLM.from_loaded(loaded_int8_activations)
    rounded = engine.generate(PROMPTS, params, use_tqdm=False)
    assert engine.engine.runner.forward.native is not None  # the one-call decoder ran it
    # Measured at the time of writing over 6 prompts x 64 tokens: greedy agreed for the first 5-64 tokens, each
    # agreeing token's log-probability off by 0.037 on average (0.052 on these three prompts) and 0.19 at most.
    deviations = []
    for a, b in zip(exact, rounded):
        for step, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)):
            if x != y:
                break
            deviations.append(abs(a.outputs[0].logprobs[step][x].logprob - b.outputs[0].logprobs[step][y].logprob))
    assert len(deviations) >= 3 * 12
    assert max(deviations) <= 0.3 and sum(deviations) / len(deviations) <= 0.08, deviations


def test_a_long_prompt_scores_like_the_exact_engine(loaded_packed, loaded_int8_activations):
    """400 prompt tokens: products of that many rows take the GEMM, with int8 activations where the CPU has it."""
    ids = loaded_packed.tokenizer.encode(TEXT.read_text())[:400]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    scores = []
    for loaded in (loaded_packed, loaded_int8_activations):
        (output,) = LLM.from_loaded(loaded).generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        scores.append([position[token].logprob for position, token in zip(output.prompt_logprobs[1:], ids[1:])])
    # Measured at the time of writing (int8 activations in the GEMM, as in decode steps): 0.067 on average, 0.39 at
    # most, perplexity 0.15% apart (0.23% over 1,024 tokens). Rounding to bfloat16 instead had given 0.013 / 0.10.
    deviations = [abs(a - b) for a, b in zip(*scores)]
    assert max(deviations) <= 0.6 and sum(deviations) / len(deviations) <= 0.1
    exact, rounded = (math.exp(-sum(s) / len(s)) for s in scores)
    assert abs(rounded / exact - 1) <= 0.01


def test_a_setting_without_effect_is_refused(default_model_path, loaded_packed):
    with pytest.raises(InvalidParameterError, match="quantized weights") as info:
        EngineConfig.from_flat(quantization="none", int8_activations=True)
    assert info.value.param == "int8_activations"
    with pytest.raises(InvalidParameterError, match="has none with quantization='none'"):
        load_model(default_model_path, quantization="none", int8_activations=True)
    with pytest.raises(InvalidParameterError, match="loaded with int8_activations=False"):
        LLM.from_loaded(loaded_packed, int8_activations=True)
