"""trace_stages: the step's own distribution after each sampling stage, recorded as the sampler computed it.

The reference applies the (transformers-checked) processors one by one to the same logits; the recorded stages
must equal them, in the sampler's order, and the last one must be the distribution the token was drawn from.
"""

from __future__ import annotations

import pytest
import torch
from sampling_helpers import make_state, random_logits

from tokenriver.errors import InvalidParameterError
from tokenriver.params import SamplingParams
from tokenriver.sampling import processors
from tokenriver.sampling.sampler import Sampler

VOCAB_SIZE = 300


def staged(**settings) -> SamplingParams:
    return SamplingParams(trace=True, trace_stages=True, **settings)


def bitmask(allowed: list[int], vocab_size: int) -> torch.Tensor:
    """[W] int32 grammar bitmask allowing exactly `allowed`."""
    bits = torch.zeros((vocab_size + 31) // 32 * 32, dtype=torch.int64)
    bits[allowed] = 1
    words = (bits.reshape(-1, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def reference_stages(row: torch.Tensor, history: list[int], params: SamplingParams) -> list[tuple[str, torch.Tensor]]:
    """Each stage's logits [V] after it, in the sampler's order, for the stages these tests use."""
    logits = row.unsqueeze(0)
    history_ids = torch.tensor([history])
    steps = [
        ("penalty", params.repetition_penalty != 1.0, lambda x: processors.apply_repetition_penalty(
            x, history_ids, torch.tensor([params.repetition_penalty]))),
        ("temperature", params.temperature != 1.0, lambda x: processors.apply_temperature(
            x, torch.tensor([params.temperature]))),
        ("top_k", params.top_k > 0, lambda x: processors.apply_top_k(x, torch.tensor([params.top_k]))),
        ("top_p", params.top_p < 1.0, lambda x: processors.apply_top_p(x, torch.tensor([params.top_p]))),
        ("min_p", params.min_p > 0.0, lambda x: processors.apply_min_p(x, torch.tensor([params.min_p]))),
    ]  # fmt: skip
    stages = []
    for name, is_used, process in steps:
        if is_used:
            logits = process(logits)
            stages.append((name, logits[0]))
    return stages


def test_each_stage_is_recorded_in_order_with_the_steps_own_numbers():
    logits = random_logits(3, VOCAB_SIZE, seed=4)
    params = staged(temperature=0.7, top_k=40, top_p=0.8, min_p=0.05, repetition_penalty=1.3, trace_top=12)
    history = [3, 17, 17, 250]
    states = [
        make_state(SamplingParams(temperature=0.9), seed=1),
        make_state(params, prompt=history[:2], output=history[2:], seed=2),
        make_state(SamplingParams(trace=True, temperature=0.5), seed=3),
    ]
    results = Sampler(torch.Generator().manual_seed(0)).sample(logits, states)
    trace = results[1].trace
    assert results[2].trace.stages is None and results[0].trace is None
    expected = reference_stages(logits[1], history, params)
    assert [s.name for s in trace.stages] == [name for name, _ in expected] == [
        "penalty", "temperature", "top_k", "top_p", "min_p"]  # fmt: skip
    ids = [c.token_id for c in trace.candidates]
    for stage, (name, reference) in zip(trace.stages, expected):
        probs = reference.softmax(dim=0)
        assert stage.probs == pytest.approx(probs[ids].tolist(), abs=1e-6), name
        assert stage.num_kept == int(torch.isfinite(reference).sum()), name
        assert [v is None for v in stage.logits] == torch.isinf(reference[ids]).tolist(), name
    # The last stage is the distribution the token was drawn from, bit for bit.
    assert trace.stages[-1].probs == [c.prob_final for c in trace.candidates]
    assert trace.stages[-1].num_kept == trace.num_candidates_kept
    # Something really was filtered, and the draw landed on a kept token.
    assert trace.stages[-1].num_kept < trace.stages[1].num_kept
    assert trace.stages[-1].probs[ids.index(trace.chosen_token_id)] > 0


def test_a_rows_stages_do_not_depend_on_its_batch():
    logits = random_logits(4, VOCAB_SIZE, seed=5)
    params = staged(temperature=1.4, top_p=0.6, trace_top=8)
    alone = Sampler(torch.Generator()).sample(logits[2:3], [make_state(params, seed=9)])[0].trace
    states = [make_state(staged(temperature=0.3, top_k=5), seed=i) for i in range(4)]
    states[2] = make_state(params, seed=9)
    batched = Sampler(torch.Generator()).sample(logits, states)[2].trace
    assert batched.to_dict() == alone.to_dict()


def test_greedy_rows_record_the_stages_they_ran():
    logits = random_logits(1, VOCAB_SIZE, seed=6)
    plain = Sampler(torch.Generator()).sample(logits, [make_state(staged(temperature=0.0))])[0].trace
    assert plain.stages == [] and plain.method == "greedy"
    biased = staged(temperature=0.0, logit_bias={7: 5.0})
    trace = Sampler(torch.Generator()).sample(logits, [make_state(biased)])[0].trace
    assert [s.name for s in trace.stages] == ["bias"]
    assert trace.to_dict()["stages"][0]["name"] == "bias"


def test_a_constrained_step_lists_the_tokens_its_grammar_allowed():
    logits = torch.linspace(0.0, -30.0, VOCAB_SIZE).unsqueeze(0)  # token i has the i-th largest logit
    allowed = [120, 150, 151, 290]
    state = make_state(staged(temperature=0.8, trace_top=5), seed=3)
    state.allowed_token_mask = bitmask(allowed, VOCAB_SIZE)
    trace = Sampler(torch.Generator()).sample(logits, [state])[0].trace
    ids = [c.token_id for c in trace.candidates]
    # The five most likely (all removed by the grammar), then every allowed one, with its true rank.
    assert ids == [0, 1, 2, 3, 4, *allowed]
    assert [c.rank for c in trace.candidates] == [i + 1 for i in ids]
    assert [c.removed_by for c in trace.candidates] == ["grammar"] * 5 + [None] * 4
    grammar = trace.stages[[s.name for s in trace.stages].index("grammar")]
    assert sum(grammar.probs) == pytest.approx(1.0, abs=1e-6)
    assert grammar.num_kept == len(allowed) == trace.extra["grammar"]["num_allowed"]
    assert trace.chosen_token_id in allowed


def test_trace_stages_needs_trace():
    with pytest.raises(InvalidParameterError) as error:
        SamplingParams(trace_stages=True)
    assert error.value.param == "trace_stages"
