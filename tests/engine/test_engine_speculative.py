"""Speculative decoding end to end: the same greedy tokens, logprobs and traces as without it, plus its stats."""

from __future__ import annotations

import pytest

from tokenriver.config import EngineConfig
from tokenriver.decoding import draft_model
from tokenriver.engine.llm import LLM
from tokenriver.params import SamplingParams

TEXT = (
    "The river carries the tokens downstream. Each token is a small boat; the cache is the harbour where "
    "the boats rest, and the scheduler decides which boats sail at every step."
)
CODE = (
    "def area(width, height):\n    return width * height\n\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n"
)
# Input-grounded prompts, where n-gram drafts hit, and open ones, where they mostly miss.
PROMPTS = [
    [{"role": "user", "content": f"Repeat this text exactly:\n{TEXT}"}],
    [{"role": "user", "content": f"Rewrite this code with type hints:\n{CODE}"}],
    [{"role": "user", "content": "Name three rivers in Europe."}],
    [{"role": "user", "content": f"Copy this list: {', '.join(str(i) for i in range(40, 70))}"}],
    [{"role": "user", "content": "Write a haiku about a cache."}],
]


def make_llm(loaded, **options) -> LLM:
    # One thread: on a shared 2-core machine a second OpenMP thread that loses its core stalls every op.
    return LLM.from_loaded(
        loaded, **{"max_num_kv_tokens": 8192, "max_num_batched_tokens": 96, "num_threads": 1, **options}
    )


GREEDY = SamplingParams(max_tokens=32, temperature=0.0, logprobs=3)


@pytest.fixture(scope="module")
def plain(loaded_float32):
    """Every prompt without speculation, batched, and the forward passes that took."""
    llm = make_llm(loaded_float32)
    outputs = llm.chat(PROMPTS, GREEDY, use_tqdm=False)
    return outputs, llm.engine.runner.num_forward_passes


def assert_same_tokens_and_logprobs(expected, got) -> None:
    want, have = expected.outputs[0], got.outputs[0]
    assert have.token_ids == want.token_ids
    assert have.text == want.text
    for position_want, position_have in zip(want.logprobs, have.logprobs):
        assert position_have.keys() == position_want.keys()
        for token_id, logprob in position_want.items():
            assert position_have[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-4)
            assert position_have[token_id].rank == logprob.rank
    assert have.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)


def test_greedy_ngram_speculation_gives_the_same_tokens_and_logprobs(loaded_float32, plain):
    expected, plain_passes = plain
    llm = make_llm(loaded_float32, speculative_draft="ngram", num_speculative_tokens=5)
    outputs = llm.chat(PROMPTS, GREEDY, use_tqdm=False)
    for want, got in zip(expected, outputs):
        assert_same_tokens_and_logprobs(want, got)
    stats = llm.engine.scheduler.stats()
    assert stats.num_draft_tokens_total == sum(o.metrics.num_draft_tokens for o in outputs) > 0
    assert stats.num_accepted_draft_tokens_total == sum(o.metrics.num_accepted_draft_tokens for o in outputs) > 0
    assert llm.engine.runner.num_forward_passes < plain_passes
    assert stats.num_blocks_used == 0


def test_greedy_self_draft_gives_the_same_tokens_and_logprobs(loaded_float32, plain):
    expected, _ = plain
    llm = make_llm(loaded_float32, speculative_draft="self:4", num_speculative_tokens=2)
    outputs = llm.chat(PROMPTS[:3], GREEDY, use_tqdm=False)
    for want, got in zip(expected, outputs):
        assert_same_tokens_and_logprobs(want, got)
    assert sum(o.metrics.num_draft_tokens for o in outputs) > 0
    assert llm.engine.last_step.num_draft_forward_passes > 0
    assert llm.engine.speculator.proposer.block_manager.num_used_blocks == 0


def test_traces_under_speculation_are_the_models_and_say_which_drafts_stood(loaded_float32, plain):
    params = SamplingParams(max_tokens=24, temperature=0.0, trace=True)
    (want,) = make_llm(loaded_float32).chat([PROMPTS[0]], params, use_tqdm=False)
    llm = make_llm(loaded_float32, speculative_draft="ngram", num_speculative_tokens=6)
    (got,) = llm.chat([PROMPTS[0]], params, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    metrics = got.metrics
    assert metrics.draft_acceptance_rate > 0.5 and metrics.mean_accepted_length > 2
    for step_want, step_have in zip(want.outputs[0].trace, got.outputs[0].trace):
        assert step_have.index == step_want.index and step_have.chosen_token_id == step_want.chosen_token_id
        assert step_have.chosen_prob_raw == pytest.approx(step_want.chosen_prob_raw, abs=1e-4)
        assert step_have.entropy_raw == pytest.approx(step_want.entropy_raw, abs=1e-3)
        assert [c.token_id for c in step_have.candidates] == [c.token_id for c in step_want.candidates]
    verdicts = [step.extra.get("speculative") for step in got.outputs[0].trace]
    assert sum(bool(v and v["accepted"]) for v in verdicts) == metrics.num_accepted_draft_tokens
    for step, verdict in zip(got.outputs[0].trace, verdicts):
        if verdict is not None and verdict["accepted"]:
            assert step.chosen_token_id == verdict["draft_token_id"]


def test_sampled_speculation_in_a_busy_batch(loaded_float32):
    """Greedy and sampled requests, a long prompt chunked next to verifications: greedy tokens stay the plain
    ones, sampled requests finish with their token counts, logprobs line up with tokens, and the pool empties."""
    long_prompt = [{"role": "user", "content": "Tell me about rivers. " * 30}]
    prompts = PROMPTS[:2] + [long_prompt] + PROMPTS[3:5]
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    sampled = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=3, logprobs=1, ignore_eos=True)
    params = [greedy, sampled, greedy, sampled, greedy]
    plain_outputs = make_llm(loaded_float32, max_num_batched_tokens=48).chat(prompts, params, use_tqdm=False)
    llm = make_llm(loaded_float32, speculative_draft="ngram", max_num_batched_tokens=48)
    outputs = llm.chat(prompts, params, use_tqdm=False)
    for p, expected, got in zip(params, plain_outputs, outputs):
        if p.is_greedy:
            assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        else:
            completion = got.outputs[0]
            assert len(completion.token_ids) == 20 == len(completion.logprobs)
            assert all(token_id in position for token_id, position in zip(completion.token_ids, completion.logprobs))
    assert llm.engine.scheduler.stats().num_blocks_used == 0


def test_a_draft_model_from_a_path_that_is_the_model_itself_is_always_right(loaded_float32, plain):
    """The draft-model path machinery (own KV pool, catch-up, k passes): a draft identical to the model must
    have every greedy draft accepted, and change nothing."""
    expected, _ = plain
    llm = make_llm(loaded_float32, speculative_draft=loaded_float32.path, num_speculative_tokens=3)
    (output,) = llm.chat(PROMPTS[:1], SamplingParams(max_tokens=16, temperature=0.0, logprobs=3), use_tqdm=False)
    assert output.outputs[0].token_ids == expected[0].outputs[0].token_ids[:16]
    assert output.metrics.num_draft_tokens > 0
    assert output.metrics.num_accepted_draft_tokens == output.metrics.num_draft_tokens


@pytest.mark.parametrize(("target", "draft"), [("none", "auto"), ("auto", "auto"), ("int8", "int8"), ("int4", "int4")])
def test_a_draft_model_is_kept_quantized_when_the_target_is_float(monkeypatch, loaded_float32, target, draft):
    """A float target (quantization "none") gets its draft with "auto": a GGUF draft stays packed, and fast."""
    seen = []

    def fake_load(path, dtype, device, quantization):
        seen.append(quantization)
        return loaded_float32

    monkeypatch.setattr(draft_model, "load_model", fake_load)
    config = EngineConfig.from_flat(quantization=target)
    draft_model.DraftModelProposer.from_path(loaded_float32.path, loaded_float32, config, num_kv_blocks=8)
    assert seen == [draft]
