"""RequestMetrics.num_forward_passes counts the passes that computed a request, not its tokens: alone in the engine,
a request took every pass the engine ran, whether it decoded plainly, in chunks, under speculation, with n samples
or with beams; and the pass log lists it in each."""

from __future__ import annotations

import pytest

from tokenriver.engine.llm import LLM
from tokenriver.params import SamplingParams

COPY = "Repeat this list exactly: " + ", ".join(str(i) for i in range(40, 90))
CASES = {
    "greedy": ({}, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
    "chunked": ({"max_num_batched_tokens": 16}, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)),
    "ngram": (
        {"speculative_draft": "ngram", "num_speculative_tokens": 5},
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    ),
    "n=3": ({}, SamplingParams(n=3, max_tokens=8, temperature=0.8, seed=1, ignore_eos=True)),
    "beams": ({}, SamplingParams(beam_width=3, max_tokens=6, ignore_eos=True)),
}


@pytest.mark.parametrize("case", CASES)
def test_a_request_alone_took_every_pass_the_engine_ran(loaded_default, case):
    options, params = CASES[case]
    llm = LLM.from_loaded(loaded_default, max_num_kv_tokens=4096, **options)
    (output,) = llm.generate([COPY], params, use_tqdm=False)
    engine_passes = llm.engine.runner.num_forward_passes
    assert output.metrics.num_forward_passes == engine_passes
    assert all(
        output.request_id in {row.request_id.split("#")[0] for row in entry.rows} for entry in llm.engine.pass_log
    )
    num_tokens = max(len(sample.token_ids) for sample in output.outputs)
    if case == "greedy":
        assert engine_passes == num_tokens  # the prompt's pass samples the first token
    if case == "chunked":
        num_prompt = len(output.prompt_token_ids)
        assert engine_passes == -(-num_prompt // 16) + num_tokens - 1
    if case == "ngram":
        accepted = output.metrics.num_accepted_draft_tokens
        assert accepted > 0 and engine_passes < num_tokens
