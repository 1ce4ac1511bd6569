"""Multi-step scheduling end to end: several forward passes per step give the tokens and text of one per step."""

from __future__ import annotations

import pytest

from tokenriver.config import EngineConfig
from tokenriver.engine import llm as llm_module
from tokenriver.engine.llm import LLM, OFFLINE_SCHEDULER_STEPS
from tokenriver.errors import InvalidParameterError
from tokenriver.loader.load import load_model
from tokenriver.params import SamplingParams

PROMPTS = ["The river carries", "Write a haiku about tokens.", "1, 2, 3, 4,", "Paris is the capital of"]


def run(loaded, num_scheduler_steps: int, params: list[SamplingParams]):
    llm = LLM.from_loaded(loaded, max_num_kv_tokens=4096, num_scheduler_steps=num_scheduler_steps)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    stats = llm.engine.scheduler.stats()
    assert stats.num_blocks_used == 0
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs], llm


def test_multi_step_gives_the_tokens_and_text_of_single_steps(loaded_float32):
    # max_tokens not multiples of the passes; one request may stop on EOS mid-step.
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=m != 13) for m in (5, 13, 9, 22)]
    single, single_llm = run(loaded_float32, 1, params)
    multi, multi_llm = run(loaded_float32, 4, params)
    assert multi == single
    single_steps = single_llm.engine.scheduler.stats().num_steps
    multi_steps = multi_llm.engine.scheduler.stats().num_steps
    assert multi_steps < single_steps / 2
    # Every token still takes its own forward pass (plus the rows of finished requests' dropped tokens).
    assert multi_llm.engine.runner.num_forward_passes >= max(len(tokens) for tokens, _, _ in multi)


def test_multi_step_leaves_other_sampling_to_single_steps(loaded_float32):
    # A seeded temperature request in the batch: its steps take one pass, and nothing changes for anyone.
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, stop=["\n"]),
    ]
    single, _ = run(loaded_float32, 1, params)
    multi, multi_llm = run(loaded_float32, 4, params)
    assert multi == single
    assert multi_llm.engine.runner.num_forward_passes == multi_llm.engine.scheduler.stats().num_steps


def test_multi_step_with_int8_activations_and_kv(default_model_path):
    # The benchmarks' configuration: the native decoder and the fused argmax product, 8 passes a step.
    loaded = load_model(default_model_path, quantization="int8", int8_activations=True)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (7, 16, 3, 11)]
    llms = [
        LLM.from_loaded(loaded, max_num_kv_tokens=4096, kv_cache_dtype="int8", num_scheduler_steps=steps)
        for steps in (1, 8)
    ]
    single, multi = ([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] for llm in llms)
    assert multi == single


def test_queued_passes_give_the_tokens_and_logprobs_of_single_steps(default_model_path, monkeypatch):
    # bfloat16 on the CPU: no native decoder, so the later passes run as on a GPU, queued on the device with each
    # argmax fed to the next pass without coming back to the host.
    loaded = load_model(default_model_path, dtype="bfloat16", quantization="none")
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=m != 9) for m in (6, 11, 9, 3)]
    single = LLM.from_loaded(loaded, max_num_kv_tokens=4096, num_scheduler_steps=1)
    queued = LLM.from_loaded(loaded, max_num_kv_tokens=4096, num_scheduler_steps=4)
    greedy = queued.engine.runner.greedy
    greedy.queue_on_device = True
    queued_passes = []
    run_queued = greedy._queued
    monkeypatch.setattr(greedy, "_queued", lambda *args: queued_passes.append(run_queued(*args)) or queued_passes[-1])
    expected, got = (llm.generate(PROMPTS, params, use_tqdm=False) for llm in (single, queued))
    assert sum(queued_passes) > 0
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert have.outputs[0].text == want.outputs[0].text
        assert have.outputs[0].finish_reason == want.outputs[0].finish_reason
        assert have.outputs[0].cumulative_logprob == pytest.approx(want.outputs[0].cumulative_logprob, abs=1e-3)
    assert queued.engine.scheduler.stats().num_blocks_used == 0


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_scheduler_steps": 0}, "num_scheduler_steps=0 must be an integer >= 1"),
        ({"num_scheduler_steps": 4, "speculative_draft": "ngram"}, "does not combine with speculative decoding"),
        ({"num_scheduler_steps": 4, "use_kv_cache": False}, "needs use_kv_cache"),
    ],
)
def test_bad_multi_step_settings_are_refused(options, message):
    with pytest.raises(InvalidParameterError, match=message) as error:
        EngineConfig.from_flat(**options)
    assert error.value.param == "num_scheduler_steps"


@pytest.mark.parametrize(
    "options, steps",
    [
        ({}, OFFLINE_SCHEDULER_STEPS),
        ({"num_scheduler_steps": 2}, 2),
        ({"speculative_draft": "ngram"}, 1),
        ({"use_kv_cache": False}, 1),
    ],
)
def test_offline_runs_multi_step_by_default_where_the_config_allows_it(monkeypatch, options, steps):
    built = []
    monkeypatch.setattr(llm_module, "EngineCore", built.append)
    LLM(**options)
    assert built[0].scheduler.num_scheduler_steps == steps
