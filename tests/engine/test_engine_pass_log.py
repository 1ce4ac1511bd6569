"""EngineCore.pass_log: which requests each forward pass carried, as prompt chunks or decode rows, and its time."""

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
    counters = [entry.num_forward_passes for entry in log]
    assert counters == list(range(1, llm.engine.runner.num_forward_passes + 1))
    # One pass computes both prompts (and samples each one's first token); then one decode row each per pass.
    first = log[0].rows
    assert [row.is_prompt for row in first] == [True, True]
    assert sorted(row.num_tokens for row in first) == prompt_lengths
    for entry in log[1:]:
        assert [(row.is_prompt, row.num_tokens) for row in entry.rows] == [(False, 1), (False, 1)]
    assert len(log) == 3
    assert len({row.request_id for entry in log for row in entry.rows}) == 2


def test_each_logged_pass_has_its_time_context_and_logit_rows(loaded_packed):
    llm = LLM.from_loaded(loaded_packed, max_num_kv_tokens=1024)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (output,) = llm.generate(["The river carries"], params, use_tqdm=False)
    log = list(llm.engine.pass_log)
    assert [entry.num_passes for entry in log] == [1, 1, 1]
    assert all(entry.seconds > 0 for entry in log)
    # The passes' times are part of the steps' and add up to less than the request took.
    metrics = output.metrics
    assert sum(entry.seconds for entry in log) < metrics.last_token_time - metrics.arrival_time
    num_prompt = len(output.prompt_token_ids)
    # The context a row attends to grows by one slot a pass; every pass samples its one row.
    assert [entry.rows[0].num_context_tokens for entry in log] == [num_prompt, num_prompt + 1, num_prompt + 2]
    assert [entry.rows[0].num_logit_rows for entry in log] == [1, 1, 1]


def test_a_prompt_chunk_short_of_the_prompts_end_computes_no_logits(loaded_packed):
    llm = LLM.from_loaded(loaded_packed, max_num_kv_tokens=1024, max_num_batched_tokens=16, block_size=16)
    prompt = list(range(100, 140))  # 40 tokens: chunks of 16, 16 and 8
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    rows = [entry.rows[0] for entry in llm.engine.pass_log]
    assert [(row.num_tokens, row.num_context_tokens, row.num_logit_rows) for row in rows] == [
        (16, 16, 0),
        (16, 32, 0),
        (8, 40, 1),
    ]
