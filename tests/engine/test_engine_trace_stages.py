"""trace_stages through the engine: what a generation records at each step is what a replay of that step computes.

A replay is a one-token request for the same context with the settings cut off after one stage. With the default
(exact) numerics, its final distribution must equal the stage the generation recorded, so a page may show the
recorded step and keep replays for what-ifs only.
"""

from __future__ import annotations

import dataclasses

import pytest

from tokenriver.engine.llm import LLM
from tokenriver.params import SamplingParams

PROMPT = "The three primary colors are"
SETTINGS = {"temperature": 0.8, "top_k": 30, "top_p": 0.9, "min_p": 0.02, "repetition_penalty": 1.2}
# Each stage's replay: the settings that stop right after it (later controls at their neutral values).
CUT_AFTER = {
    "penalty": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
    "temperature": {"top_k": 0, "top_p": 1.0, "min_p": 0.0},
    "top_k": {"top_p": 1.0, "min_p": 0.0},
    "top_p": {"min_p": 0.0},
    "min_p": {},
}


@pytest.fixture(scope="module")
def llm(loaded_default):
    return LLM.from_loaded(loaded_default, max_num_kv_tokens=2048)


def _one_step(llm: LLM, prompt_ids: list[int], params: SamplingParams):
    (output,) = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    return output.outputs[0].trace[0]


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_a_replay_of_each_stage_equals_the_recorded_step(llm, temperature):
    params = SamplingParams(
        **{**SETTINGS, "temperature": temperature}, max_tokens=5, seed=3, trace=True, trace_stages=True, trace_top=8
    )
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)
    completion = output.outputs[0]
    assert len(completion.trace) == len(completion.token_ids)
    for step in (1, len(completion.token_ids) - 1):
        recorded = completion.trace[step]
        names = [stage.name for stage in recorded.stages]
        assert names == (["penalty"] if temperature == 0 else list(CUT_AFTER))
        context = list(output.prompt_token_ids) + completion.token_ids[:step]
        ids = [c.token_id for c in recorded.candidates]
        for stage in recorded.stages:
            cut = dataclasses.replace(params, max_tokens=1, trace_stages=False, seed=None, **CUT_AFTER[stage.name])
            replay = _one_step(llm, context, cut)
            # The replay's candidates are the same top tokens, with the same raw numbers (the chosen token, added
            # when it ranks lower, may differ).
            shown = min(len(ids), len(replay.candidates)) - 1
            assert [(c.token_id, c.prob_raw) for c in replay.candidates[:shown]] == [
                (c.token_id, c.prob_raw) for c in recorded.candidates[:shown]
            ]
            final = {c.token_id: c.prob_final for c in replay.candidates}
            for token_id, prob in zip(ids, stage.probs):
                if token_id in final:
                    assert prob == pytest.approx(final[token_id], abs=1e-6), (step, stage.name, token_id)
            assert stage.num_kept == replay.num_candidates_kept
