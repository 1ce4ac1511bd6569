"""Decoding controls through the whole engine: seeds, n / best_of, stops, streaming, traces, logprobs."""

from __future__ import annotations

import math

import pytest

from tokenriver.engine.llm import LLM
from tokenriver.outputs import FinishReason
from tokenriver.params import SamplingParams

PROMPT = "Write a short story about a robot who learns to paint."


@pytest.fixture(scope="module")
def llm(loaded_float32):
    return LLM.from_loaded(loaded_float32, max_num_kv_tokens=8192)


def test_same_seed_same_tokens_alone_and_in_a_batch(llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    (alone,) = llm.generate([PROMPT], params, use_tqdm=False)
    (again,) = llm.generate([PROMPT], params, use_tqdm=False)
    neighbours = SamplingParams(max_tokens=24, temperature=1.2, ignore_eos=True)
    batch = llm.generate(["Hello there", PROMPT, "1, 2, 3,"], [neighbours, params, neighbours], use_tqdm=False)
    assert alone.outputs[0].token_ids == again.outputs[0].token_ids == batch[1].outputs[0].token_ids
    other_seed = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True)
    (different,) = llm.generate([PROMPT], other_seed, use_tqdm=False)
    assert different.outputs[0].token_ids != alone.outputs[0].token_ids


def test_n_returns_that_many_candidates(llm):
    (output,) = llm.generate(
        [PROMPT], SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True), use_tqdm=False
    )
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1


def test_best_of_returns_the_most_likely_candidate(llm):
    params = SamplingParams(n=1, best_of=4, temperature=1.0, max_tokens=10, seed=3, logprobs=0, ignore_eos=True)
    (best,) = llm.generate([PROMPT], params, use_tqdm=False)
    (everything,) = llm.generate(
        [PROMPT],
        SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=3, logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(best.outputs) == 1
    chosen = best.outputs[0]
    summed = sum(position[token].logprob for token, position in zip(chosen.token_ids, chosen.logprobs))
    assert chosen.cumulative_logprob == pytest.approx(summed, abs=1e-4)
    assert chosen.cumulative_logprob == pytest.approx(max(c.cumulative_logprob for c in everything.outputs), abs=1e-4)


def test_stop_string_is_cut_and_reported(llm):
    (free,) = llm.generate(["Count: 1, 2, 3,"], SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
    text = free.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    (stopped,) = llm.generate(
        ["Count: 1, 2, 3,"], SamplingParams(max_tokens=20, temperature=0.0, stop=[stop]), use_tqdm=False
    )
    completion = stopped.outputs[0]
    assert completion.finish_reason == FinishReason.STOP and completion.stop_reason == stop
    assert completion.text == text[: text.index(stop)]
    (kept,) = llm.generate(
        ["Count: 1, 2, 3,"],
        SamplingParams(max_tokens=20, temperature=0.0, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_streamed_deltas_equal_final_text(llm):
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=5, stop=["\n\n"])
    deltas, final = [], None
    for output in llm.stream("Tell me about Paris 🗼 and 東京.", params):
        deltas.append(output.outputs[0].delta_text)
        final = output
    assert final.finished
    assert "".join(deltas) == final.outputs[0].text


def test_max_tokens_and_min_tokens(llm):
    (output,) = llm.generate(["Hi"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 5 and output.outputs[0].finish_reason == FinishReason.LENGTH
    eos = llm.get_tokenizer().eos_token_ids
    params = SamplingParams(max_tokens=30, min_tokens=30, temperature=0.0, stop_token_ids=list(eos))
    (forced,) = llm.chat([{"role": "user", "content": "Say yes."}], params, use_tqdm=False)
    assert len(forced.outputs[0].token_ids) == 30
    assert not set(forced.outputs[0].token_ids) & set(eos)


def test_trace_explains_each_token(llm):
    params = SamplingParams(max_tokens=8, temperature=0.7, top_k=20, top_p=0.9, seed=11, trace=True, trace_top=10)
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)
    completion = output.outputs[0]
    assert len(completion.trace) == len(completion.token_ids)
    for token_id, step in zip(completion.token_ids, completion.trace):
        assert step.chosen_token_id == token_id
        assert token_id in [c.token_id for c in step.candidates]
        assert sum(c.prob_final for c in step.candidates) <= 1 + 1e-5
        assert all(c.text for c in step.candidates)
    (greedy,) = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0, trace=True), use_tqdm=False)
    assert all(step.chosen_rank == 1 for step in greedy.outputs[0].trace)


def test_logprobs_are_raw_model_logprobs(llm):
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, prompt_logprobs=3)
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)
    completion = output.outputs[0]
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        assert position[token_id].rank == 1
        assert len(position) == 5
        assert sum(math.exp(lp.logprob) for lp in position.values()) <= 1 + 1e-5
    assert output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(output.prompt_token_ids)
    for token_id, position in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
        assert token_id in position
