"""EngineCore.pass_log: which requests each forward pass carried, as prompt chunks or decode rows."""

from __future__ import annotations

from tokenriver.engine.llm import LLM
from tokenriver.params import SamplingParams


def test_pass_log_lists_each_pass_with_the_requests_it_batched(loaded_packed):
    llm = LLM.from_loaded(loaded_packed, max_num_kv_tokens=1024)
    prompts = ["The river carries", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompt_lengths = sorted(len(llm.engine.tokenizer.encode(p)) for p in prompts)
    llm.generate(prompts, [params, params], use_tqdm=False)
    log = list(llm.engine.pass_log)
    counters = [counter for counter, _ in log]
    assert counters == list(range(1, llm.engine.runner.num_forward_passes + 1))
    # One pass computes both prompts (and samples each one's first token); then one decode row each per pass.
    first = log[0][1]
    assert [row.is_prompt for row in first] == [True, True]
    assert sorted(row.num_tokens for row in first) == prompt_lengths
    for _, rows in log[1:]:
        assert [(row.is_prompt, row.num_tokens) for row in rows] == [(False, 1), (False, 1)]
    assert len(log) == 3
    assert len({row.request_id for _, rows in log for row in rows}) == 2
