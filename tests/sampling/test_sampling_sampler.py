"""The Sampler: greedy, seeds and batch independence, raw logprobs, prompt logprobs, traces."""

from __future__ import annotations

import math

import pytest
import torch
from sampling_helpers import make_state, random_logits

from tokenriver.models.cpu.kernels import load_kernels
from tokenriver.params import SamplingParams
from tokenriver.sampling import processors
from tokenriver.sampling.sampler import NUM_DRAW_NEIGHBORS, Sampler, SamplingState
from tokenriver.trace import STAGES

VOCAB_SIZE = 500


def new_sampler(seed: int = 0) -> Sampler:
    return Sampler(torch.Generator().manual_seed(seed))


def raw_rank(row: torch.Tensor, token_id: int) -> int:
    """1-based position of token_id in the row sorted by logit, best first (rows here have no ties)."""
    return int((row.argsort(descending=True) == token_id).nonzero()) + 1


# ---------------------------------------------------------------- greedy


def test_greedy_is_the_argmax_of_the_raw_logits():
    logits = random_logits(6, VOCAB_SIZE, seed=1)
    states = [make_state(SamplingParams(temperature=0.0, top_k=3, top_p=0.5)) for _ in range(6)]
    results = new_sampler().sample(logits, states)
    assert [r.token_id for r in results] == logits.argmax(dim=1).tolist()
    assert all(r.logprob.rank == 1 for r in results)


def test_greedy_picks_the_argmax_after_penalties_bias_and_min_tokens():
    logits = random_logits(3, VOCAB_SIZE, seed=2)
    top = logits.argmax(dim=1).tolist()
    states = [
        make_state(SamplingParams(temperature=0.0, repetition_penalty=100.0), prompt=[top[0]]),
        make_state(SamplingParams(temperature=0.0, logit_bias={7: 100.0})),
        make_state(SamplingParams(temperature=0.0, min_tokens=2), output=[1], eos=[top[2]]),
    ]
    results = new_sampler().sample(logits, states)
    penalized = processors.apply_repetition_penalty(logits[:1], torch.tensor([[top[0]]]), torch.tensor([100.0]))
    assert results[0].token_id == int(penalized.argmax()) != top[0]
    assert results[1].token_id == 7
    second_best = logits[2].topk(2).indices[1]
    assert results[2].token_id == int(second_best)
    # Logprobs stay those of the raw distribution, whatever the processing.
    assert results[1].logprob.rank == raw_rank(logits[1], 7)
    assert results[2].logprob.rank == 2


def test_caller_logits_are_not_modified():
    logits = random_logits(4, VOCAB_SIZE, seed=3)
    before = logits.clone()
    states = [
        make_state(
            SamplingParams(
                temperature=0.7,
                top_k=5,
                top_p=0.9,
                min_p=0.1,
                repetition_penalty=1.5,
                presence_penalty=1.0,
                logit_bias={3: 5.0},
            ),
            prompt=[1, 2],
            output=[3],
        ),
        make_state(SamplingParams(temperature=0.0)),
        make_state(SamplingParams(temperature=1.0, min_tokens=3), eos=[2]),
        make_state(SamplingParams(temperature=0.5, trace=True)),
    ]
    new_sampler().sample(logits, states)
    assert torch.equal(logits, before)


def test_min_tokens_blocks_eos_and_stop_token_ids_when_sampling():
    logits = torch.zeros(1, VOCAB_SIZE)
    logits[0, 2] = 30.0  # EOS would be chosen almost surely
    logits[0, 9] = 29.0  # and then the stop token
    params = SamplingParams(min_tokens=3, stop_token_ids=[9])
    sampler = new_sampler()
    for num_generated in range(3):
        state = make_state(params, output=[5] * num_generated, eos=[2])
        assert sampler.sample(logits, [state])[0].token_id not in (2, 9)
    assert sampler.sample(logits, [make_state(params, output=[5, 5, 5], eos=[2])])[0].token_id == 2


# ---------------------------------------------------------------- seeds and batch independence


def run_steps(
    sampler: Sampler, rows: list[tuple[SamplingParams, int | None]], row_logits: list[torch.Tensor], num_steps: int
) -> list[list[int]]:
    """Generate num_steps tokens for every row; penalties see the growing outputs. Returns tokens per row."""
    states = [make_state(params, prompt=[1, 2, 3], seed=seed) for params, seed in rows]
    for step in range(num_steps):
        # Each row's logits change with the step, so every step draws from a different distribution.
        logits = torch.stack([base.roll(step * 7) for base in row_logits])  # [N, V]
        for state, result in zip(states, sampler.sample(logits, states)):
            state.output_token_ids.append(result.token_id)
    return [state.output_token_ids for state in states]


SEEDED = SamplingParams(temperature=0.9, top_p=0.95, frequency_penalty=0.5, seed=11)


def test_same_seed_gives_the_same_tokens():
    base = random_logits(1, VOCAB_SIZE, scale=1.0, seed=4)[0]
    first = run_steps(new_sampler(1), [(SEEDED, 11)], [base], 20)
    second = run_steps(new_sampler(2), [(SEEDED, 11)], [base], 20)
    other_seed = run_steps(new_sampler(1), [(SEEDED, 12)], [base], 20)
    assert first == second
    assert first != other_seed  # the seed matters: the test can tell


def test_seeded_row_is_independent_of_its_batch_and_row_index():
    bases = list(random_logits(5, VOCAB_SIZE, scale=1.0, seed=5))
    neighbours = [
        (SamplingParams(temperature=1.0), None),
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(temperature=0.5, top_k=20, seed=3), 3),
        (SamplingParams(temperature=1.3, min_p=0.05, repetition_penalty=1.2), None),
    ]
    alone = run_steps(new_sampler(0), [(SEEDED, 11)], [bases[0]], 15)[0]
    first_row = run_steps(new_sampler(1), [(SEEDED, 11)] + neighbours, bases, 15)[0]
    last_row = run_steps(new_sampler(2), neighbours + [(SEEDED, 11)], bases[1:] + bases[:1], 15)[-1]
    middle = run_steps(
        new_sampler(3), neighbours[:2] + [(SEEDED, 11)] + neighbours[2:], bases[1:3] + bases[:1] + bases[3:], 15
    )[2]
    assert alone == first_row == last_row == middle


def test_default_generator_is_deterministic():
    bases = list(random_logits(3, VOCAB_SIZE, scale=1.0, seed=6))
    rows = [(SamplingParams(temperature=1.0), None)] * 3
    assert run_steps(new_sampler(5), rows, bases, 10) == run_steps(new_sampler(5), rows, bases, 10)
    assert run_steps(new_sampler(5), rows, bases, 10) != run_steps(new_sampler(6), rows, bases, 10)


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=2.0, top_p=0.9),
        dict(temperature=0.0, repetition_penalty=3.0),
    ],
)
def test_chosen_logprob_and_top_alternatives_come_from_the_raw_distribution(settings):
    logits = random_logits(8, VOCAB_SIZE, scale=2.0, seed=7)
    states = [
        make_state(SamplingParams(logprobs=k, **settings), prompt=[int(logits[i].argmax())])
        for i, k in enumerate([None, 0, 1, 3, 5, 20, 2, 7])
    ]
    results = new_sampler().sample(logits, states)
    reference = logits.double().log_softmax(dim=1)
    for row, (state, result) in enumerate(zip(states, results)):
        chosen = result.token_id
        assert result.logprob.token_id == chosen
        assert result.logprob.logprob == pytest.approx(float(reference[row, chosen]), abs=1e-5)
        assert result.logprob.rank == raw_rank(logits[row], chosen)
        num_top = state.params.logprobs or 0
        assert len(result.logprob.top) == num_top
        expected = reference[row].topk(num_top) if num_top else None
        for j, (token_id, logprob) in enumerate(result.logprob.top):
            assert token_id == int(expected.indices[j])
            assert logprob == pytest.approx(float(expected.values[j]), abs=1e-5)
        logprobs = [lp for _, lp in result.logprob.top]
        assert logprobs == sorted(logprobs, reverse=True)


@pytest.mark.skipif(load_kernels() is None, reason="native kernels do not build on this machine")
def test_native_row_reductions_give_the_same_tokens_and_logprobs():
    """The runner's one-pass argmax + logsumexp: same tokens and ranks, logprobs within float rounding."""
    logits = random_logits(7, 4099, scale=3.0, seed=11)
    logits[0, 5] = logits[0, 4000] = 40.0  # a tie: the first index wins either way
    settings = [
        dict(temperature=0.0),
        dict(temperature=0.0, logprobs=3),
        dict(temperature=1.0, seed=5),
        dict(temperature=0.0, repetition_penalty=5.0),
        dict(temperature=0.0, logit_bias={9: 50.0}),
        dict(temperature=0.7, top_k=5, seed=6, logprobs=2),
        dict(temperature=0.0),
    ]
    states = [
        make_state(SamplingParams(**options), prompt=[int(logits[i].argmax())]) for i, options in enumerate(settings)
    ]
    plain = Sampler(torch.Generator().manual_seed(0)).sample(logits, states)
    states = [
        make_state(SamplingParams(**options), prompt=[int(logits[i].argmax())]) for i, options in enumerate(settings)
    ]
    calls = []

    def reductions(rows: torch.Tensor):
        calls.append(rows.shape[0])
        return load_kernels().argmax_logsumexp(rows)

    native = Sampler(torch.Generator().manual_seed(0), reductions).sample(logits, states)
    assert calls == [7]  # one pass over the step's rows, not PyTorch's reductions
    assert [r.token_id for r in native] == [r.token_id for r in plain]
    assert native[0].token_id == 5
    for ours, theirs in zip(native, plain):
        assert ours.logprob.rank == theirs.logprob.rank
        assert ours.logprob.logprob == pytest.approx(theirs.logprob.logprob, abs=1e-5)
        assert [t for t, _ in ours.logprob.top] == [t for t, _ in theirs.logprob.top]
        assert [lp for _, lp in ours.logprob.top] == pytest.approx([lp for _, lp in theirs.logprob.top], abs=1e-5)


@pytest.mark.skipif(load_kernels() is None, reason="native kernels do not build on this machine")
def test_all_greedy_rows_take_the_native_shortcut_with_the_same_results():
    """A batch of plain greedy rows is answered from the one native pass: tokens, ranks and logprobs as PyTorch's."""
    logits = random_logits(5, 4099, scale=3.0, seed=12)
    logits[2, 7] = logits[2, 3000] = 40.0  # a tie: the first index wins either way
    states = [make_state(SamplingParams(temperature=0.0)) for _ in range(5)]
    plain = Sampler(torch.Generator().manual_seed(0)).sample(logits, states)
    native = Sampler(torch.Generator().manual_seed(0), load_kernels().argmax_logsumexp).sample(logits, states)
    assert [r.token_id for r in native] == logits.argmax(dim=1).tolist() == [r.token_id for r in plain]
    assert native[2].token_id == 7
    reference = logits.double().log_softmax(dim=1)
    for row, (ours, theirs) in enumerate(zip(native, plain)):
        assert (ours.logprob.token_id, ours.logprob.rank, ours.logprob.top) == (ours.token_id, 1, [])
        assert ours.logprob.logprob == pytest.approx(theirs.logprob.logprob, abs=1e-5)
        assert ours.logprob.logprob == pytest.approx(float(reference[row, ours.token_id]), abs=1e-5)
        assert ours.trace is None


def test_all_plain_greedy_only_when_no_stage_or_report_needs_the_logits():
    plain = make_state(SamplingParams(temperature=0.0), eos=[2])
    assert Sampler.all_plain_greedy([plain, plain])
    needs_logits = [
        make_state(SamplingParams(temperature=0.7)),
        make_state(SamplingParams(temperature=0.0, logprobs=1)),
        make_state(SamplingParams(temperature=0.0, trace=True)),
        make_state(SamplingParams(temperature=0.0, repetition_penalty=1.2)),
        make_state(SamplingParams(temperature=0.0, presence_penalty=0.5)),
        make_state(SamplingParams(temperature=0.0, frequency_penalty=0.5)),
        make_state(SamplingParams(temperature=0.0, logit_bias={5: 1.0})),
        make_state(SamplingParams(temperature=0.0, min_tokens=3), output=[7], eos=[2]),
    ]
    for state in needs_logits:
        assert not Sampler.all_plain_greedy([plain, state]), state.params
    # min_tokens reached, or nothing to block: the logits are untouched again.
    assert Sampler.all_plain_greedy(
        [
            make_state(SamplingParams(temperature=0.0, min_tokens=1), output=[7], eos=[2]),
            make_state(SamplingParams(temperature=0.0, min_tokens=3)),
        ]
    )


def test_sample_reduced_answers_like_sample():
    """What the runner does when the model hands over per-row reductions instead of logits."""
    logits = random_logits(4, 999, seed=13)
    states = [make_state(SamplingParams(temperature=0.0)) for _ in range(4)]
    reduced = (logits.argmax(dim=1), logits.amax(dim=1), torch.logsumexp(logits, dim=1))
    from_logits = Sampler(torch.Generator().manual_seed(0)).sample(logits, states)
    assert Sampler.sample_reduced(reduced, states) == from_logits
    with pytest.raises(ValueError, match="len\\(states\\)=3"):
        Sampler.sample_reduced(reduced, states[:3])


def _bitmask(allowed: list[int], vocab_size: int) -> torch.Tensor:
    """[W] int32 grammar bitmask allowing exactly `allowed`."""
    bits = torch.zeros((vocab_size + 31) // 32 * 32, dtype=torch.int64)
    bits[allowed] = 1
    words = (bits.reshape(-1, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_grammar_rows_take_the_reduced_path_unless_it_refuses_the_argmax():
    """A constrained greedy row answers from the reductions when its grammar allows the raw argmax; a row whose
    grammar refuses it goes through the masked logits. Either way: the masked argmax and the raw logprob, as the
    general path (no reductions at all) gives them."""
    vocab_size = 999
    logits = random_logits(3, vocab_size, seed=21)
    top = logits.argmax(dim=1).tolist()
    allowed = [[top[0], 5, 6], [5, 6, 7], list(range(vocab_size))]  # row 1's grammar refuses its argmax
    states = [make_state(SamplingParams(temperature=0.0)) for _ in range(3)]
    for state, tokens in zip(states, allowed):
        state.allowed_token_mask = _bitmask(tokens, vocab_size)
    assert Sampler.all_plain_greedy(states)
    reduced = (logits.argmax(dim=1), logits.amax(dim=1), torch.logsumexp(logits, dim=1))
    quick = Sampler.sample_reduced(reduced, states)
    assert quick[1] is None and [quick[0].token_id, quick[2].token_id] == [top[0], top[2]]
    general = Sampler(torch.Generator().manual_seed(0)).sample(logits, states)  # no row reductions: every stage
    with_reductions = Sampler(
        torch.Generator().manual_seed(0),
        lambda rows: (rows.argmax(dim=1), rows.amax(dim=1), torch.logsumexp(rows, dim=1)),
    ).sample(logits, states)
    assert [r.token_id for r in with_reductions] == [r.token_id for r in general]
    assert general[1].token_id == max([5, 6, 7], key=lambda t: float(logits[1, t]))
    reference = logits.double().log_softmax(dim=1)
    for row, result in enumerate(with_reductions):
        assert result.logprob.logprob == pytest.approx(float(reference[row, result.token_id]), abs=1e-5)
    assert processors.allows(states[1].allowed_token_mask, 7) and not processors.allows(states[1].allowed_token_mask, 8)


def test_prompt_logprobs_match_log_softmax():
    num_positions = 300  # more than one chunk
    logits = random_logits(num_positions, VOCAB_SIZE, scale=2.0, seed=8)
    next_ids = torch.randint(0, VOCAB_SIZE, (num_positions,), generator=torch.Generator().manual_seed(8)).tolist()
    results = new_sampler().prompt_logprobs(logits, next_ids, 4)
    reference = logits.double().log_softmax(dim=1)
    assert len(results) == num_positions
    for position, (token_id, result) in enumerate(zip(next_ids, results)):
        assert result.token_id == token_id
        assert result.logprob == pytest.approx(float(reference[position, token_id]), abs=1e-5)
        assert result.rank == raw_rank(logits[position], token_id)
        best = reference[position].topk(4)
        assert [t for t, _ in result.top] == best.indices.tolist()
        assert [lp for _, lp in result.top] == pytest.approx(best.values.tolist(), abs=1e-5)
    assert all(r.top == [] for r in new_sampler().prompt_logprobs(logits[:3], next_ids[:3], 0))


# ---------------------------------------------------------------- traces


def traced(settings: dict, **state_kwargs) -> SamplingState:
    return make_state(SamplingParams(trace=True, **settings), **state_kwargs)


def check_trace_invariants(trace, logits_row: torch.Tensor, result) -> None:
    raw_probs = logits_row.double().softmax(dim=0)
    ids = [c.token_id for c in trace.candidates]
    assert trace.chosen_token_id == result.token_id
    assert result.token_id in ids
    assert sum(c.prob_raw for c in trace.candidates) <= 1 + 1e-5
    assert sum(c.prob_final for c in trace.candidates) <= 1 + 1e-5
    assert trace.chosen_rank == result.logprob.rank == raw_rank(logits_row, result.token_id)
    assert trace.chosen_prob_raw == pytest.approx(float(raw_probs[result.token_id]), abs=1e-6)
    assert trace.entropy_raw == pytest.approx(float(-(raw_probs * raw_probs.log()).sum()), abs=1e-4)
    for candidate in trace.candidates:
        assert candidate.text == ""
        assert candidate.logit == float(logits_row[candidate.token_id])
        assert candidate.prob_raw == pytest.approx(float(raw_probs[candidate.token_id]), abs=1e-6)
        assert candidate.rank == raw_rank(logits_row, candidate.token_id)
        assert (candidate.prob_final == 0.0) == (candidate.removed_by is not None)
    # Best first; an appended chosen token ranks below all the others.
    assert [c.rank for c in trace.candidates] == sorted(c.rank for c in trace.candidates)
    assert len(ids) == len(set(ids))


def test_trace_greedy_chooses_rank_one():
    logits = random_logits(2, VOCAB_SIZE, seed=9)
    states = [traced(dict(temperature=0.0, trace_top=5)), make_state(SamplingParams(temperature=0.0))]
    results = new_sampler().sample(logits, states)
    trace = results[0].trace
    assert results[1].trace is None
    assert trace.method == "greedy" and trace.temperature == 0.0
    assert trace.chosen_rank == 1 and trace.candidates[0].token_id == trace.chosen_token_id
    assert len(trace.candidates) == 5
    assert trace.index == 0
    check_trace_invariants(trace, logits[0], results[0])


def expected_removed_by(row: torch.Tensor, params: SamplingParams) -> list[str | None]:
    """Reference: run the stages one by one with the (transformers-checked) processors, note the first -inf."""
    stages = [
        ("temperature", params.temperature != 1.0, processors.apply_temperature, params.temperature),
        ("top_k", params.top_k > 0, processors.apply_top_k, params.top_k),
        ("top_p", params.top_p < 1.0, processors.apply_top_p, params.top_p),
        ("min_p", params.min_p > 0.0, processors.apply_min_p, params.min_p),
    ]
    removed_by: list[str | None] = [None] * row.shape[0]
    logits = row.unsqueeze(0)
    for stage, is_used, process, value in stages:
        if not is_used:
            continue
        logits = process(logits, torch.tensor([value]))
        for token_id in torch.isinf(logits[0]).nonzero().flatten().tolist():
            removed_by[token_id] = removed_by[token_id] or stage
    return removed_by


def test_trace_marks_the_stage_that_removed_each_candidate():
    logits = torch.linspace(0.0, -40.0, VOCAB_SIZE).unsqueeze(0).repeat(4, 1)  # token i has the i-th largest logit
    states = [
        traced(dict(top_k=3, trace_top=6)),
        traced(dict(top_p=0.5, trace_top=20)),
        traced(dict(min_p=0.9, trace_top=8)),
        traced(dict(temperature=0.8, top_k=10, top_p=0.3, min_p=0.97, trace_top=12)),
    ]
    results = new_sampler().sample(logits, states)
    removed = [[c.removed_by for c in r.trace.candidates] for r in results]
    assert removed[0] == [None] * 3 + ["top_k"] * 3
    assert results[0].trace.num_candidates_kept == 3
    for state, result, row in zip(states, results, logits):
        expected = expected_removed_by(row, state.params)
        candidates = result.trace.candidates
        assert [c.removed_by for c in candidates] == [expected[c.token_id] for c in candidates]
        assert result.trace.num_candidates_kept == expected.count(None)
        check_trace_invariants(result.trace, row, result)
        assert result.trace.method == "sample"
        kept = sum(c.prob_final for c in result.trace.candidates if c.removed_by is None)
        assert kept == pytest.approx(1.0, abs=1e-5)  # every kept token is among the candidates here
    # Each case really has victims of its stage (and the last one of three stages).
    assert "top_p" in removed[1] and None in removed[1]
    assert "min_p" in removed[2] and None in removed[2]
    assert {"top_k", "top_p", "min_p", None} <= set(removed[3])


def test_trace_marks_min_tokens_and_keeps_processed_logits():
    logits = random_logits(1, VOCAB_SIZE, seed=10)
    top = logits[0].topk(3).indices.tolist()
    state = traced(
        dict(temperature=0.0, min_tokens=2, logit_bias={top[2]: -1.5}, trace_top=3), output=[4], eos=[top[0]]
    )
    result = new_sampler().sample(logits, [state])[0]
    by_id = {c.token_id: c for c in result.trace.candidates}
    assert by_id[top[0]].removed_by == "min_tokens" and by_id[top[0]].prob_final == 0.0
    assert by_id[top[0]].logit_processed == by_id[top[0]].logit  # blocking is not a penalty
    assert by_id[top[2]].logit_processed == pytest.approx(by_id[top[2]].logit - 1.5)
    assert result.token_id == top[1] and result.trace.chosen_rank == 2
    assert result.trace.index == 1
    assert result.trace.num_candidates_kept == VOCAB_SIZE - 1


def test_trace_appends_a_chosen_token_ranked_below_the_candidates():
    logits = random_logits(1, VOCAB_SIZE, scale=0.1, seed=11)  # nearly flat: the chosen token ranks low
    state = traced(dict(temperature=1.0, trace_top=2), seed=5)
    sampler = new_sampler()
    for _ in range(5):
        result = sampler.sample(logits, [state])[0]
        trace = result.trace
        if result.logprob.rank > 2:
            assert len(trace.candidates) == 3
            last = trace.candidates[-1]
            assert last.token_id == result.token_id and last.rank == result.logprob.rank
            assert last.prob_final == pytest.approx(trace.chosen_prob_final)
            assert trace.entropy_final == pytest.approx(trace.entropy_raw, abs=1e-4)
            check_trace_invariants(trace, logits[0], result)
            return
    pytest.fail("a nearly flat distribution should pick a token below rank 2 within 5 draws")


def test_trace_final_probabilities_follow_temperature():
    logits = random_logits(1, VOCAB_SIZE, scale=2.0, seed=12)
    result = new_sampler().sample(logits, [traced(dict(temperature=0.5, trace_top=10))])[0]
    final = (logits[0].double() / 0.5).softmax(dim=0)
    for candidate in result.trace.candidates:
        assert candidate.prob_final == pytest.approx(float(final[candidate.token_id]), abs=1e-6)
    expected_entropy = float(torch.special.entr(final).sum())
    assert result.trace.entropy_final == pytest.approx(expected_entropy, abs=1e-4)
    assert result.trace.num_candidates_kept == VOCAB_SIZE
    assert result.trace.temperature == 0.5
    assert all(stage in STAGES for stage in ("penalty", "bias", "min_tokens"))
    assert math.isfinite(result.trace.chosen_prob_final) and result.trace.chosen_prob_final > 0


def test_pipeline_applies_the_stages_in_the_documented_order():
    """Trace probabilities equal the processors run by hand in order; an all-default row in the same batch stays raw."""
    logits = random_logits(2, VOCAB_SIZE, scale=1.0, seed=13)
    logits[:, 12], logits[:, 13] = 4.0, 4.5  # the stop token and EOS lead, but min_tokens blocks them
    prompt, output = [5, 6, 7, 7], [7, 8, 8, 9]
    busy = SamplingParams(
        temperature=0.7,
        top_k=80,
        top_p=0.97,
        min_p=0.01,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.6,
        logit_bias={8: 2.0, 11: -3.0},
        min_tokens=10,
        stop_token_ids=[12],
        trace=True,
        trace_top=100,
    )
    states = [
        make_state(busy, prompt=prompt, output=output, eos=[13], seed=1),
        make_state(SamplingParams(trace=True, trace_top=100), prompt=prompt, output=output, seed=2),
    ]
    results = new_sampler().sample(logits, states)

    x = logits[:1]
    x = processors.apply_repetition_penalty(x, torch.tensor([prompt + output]), torch.tensor([1.3]))
    x = processors.apply_presence_frequency_penalties(
        x, torch.tensor([output]), torch.tensor([0.4]), torch.tensor([0.6])
    )
    x = processors.apply_logit_bias(x, torch.tensor([[8, 11]]), torch.tensor([[2.0, -3.0]]))
    after_bias = x
    x = processors.apply_min_tokens(x, torch.tensor([[13, 12]]), torch.tensor([4]), torch.tensor([10]))
    x = processors.apply_temperature(x, torch.tensor([0.7]))
    x = processors.apply_top_k(x, torch.tensor([80]))
    x = processors.apply_top_p(x, torch.tensor([0.97]))
    x = processors.apply_min_p(x, torch.tensor([0.01]))
    final = x[0].softmax(dim=0)
    for candidate in results[0].trace.candidates:
        assert candidate.logit_processed == float(after_bias[0, candidate.token_id])
        assert candidate.prob_final == pytest.approx(float(final[candidate.token_id]), abs=1e-7)
    assert results[0].trace.num_candidates_kept == int(torch.isfinite(x).sum())
    by_id = {c.token_id: c for c in results[0].trace.candidates}
    assert by_id[12].removed_by == by_id[13].removed_by == "min_tokens"
    assert final[results[0].token_id] > 0

    raw = logits[1].softmax(dim=0)
    for candidate in results[1].trace.candidates:
        assert candidate.prob_final == float(raw[candidate.token_id])
        assert candidate.logit_processed == candidate.logit and candidate.removed_by is None


def test_trace_notes_where_the_draw_landed_in_the_cumulative_distribution():
    """extra["draw"]: the uniform falls inside the chosen token's span of the CDF, in token-id order."""
    logits = random_logits(1, VOCAB_SIZE, scale=2.0, seed=21)
    result = new_sampler(3).sample(logits, [traced(dict(temperature=0.9, top_p=0.9, seed=5))])[0]
    draw = result.trace.extra["draw"]
    final = next(c.prob_final for c in result.trace.candidates if c.token_id == result.token_id)
    assert draw["cdf_end"] - draw["cdf_start"] == pytest.approx(final, abs=1e-6)
    assert draw["cdf_start"] <= draw["uniform"] < draw["cdf_end"] + 1e-6
    greedy = new_sampler().sample(logits, [traced(dict(temperature=0.0))])[0]
    assert "draw" not in greedy.trace.extra


def test_a_traced_draw_lists_the_nearest_kept_tokens_end_to_end():
    """extra["draw"]["neighbors"]: the chosen token's span between those of the NUM_DRAW_NEIGHBORS tokens with
    probability on each side of it in id order, each as wide as its final probability, with no gap between them."""
    logits = random_logits(1, VOCAB_SIZE, scale=2.0, seed=22)
    result = new_sampler(4).sample(logits, [traced(dict(temperature=0.9, top_k=60, seed=6))])[0]
    draw = result.trace.extra["draw"]
    final = processors.apply_top_k(processors.apply_temperature(logits, torch.tensor([0.9])), torch.tensor([60]))
    probs = final[0].softmax(dim=0)
    kept = torch.nonzero(probs > 0).squeeze(1).tolist()
    at = kept.index(result.token_id)
    neighbors = draw["neighbors"]
    assert [n["token_id"] for n in neighbors] == kept[max(0, at - NUM_DRAW_NEIGHBORS) : at + NUM_DRAW_NEIGHBORS + 1]
    (chosen,) = [n for n in neighbors if n["token_id"] == result.token_id]
    assert (chosen["cdf_start"], chosen["cdf_end"]) == (draw["cdf_start"], draw["cdf_end"])
    for left, right in zip(neighbors, neighbors[1:]):
        assert left["cdf_end"] == right["cdf_start"]
    for n in neighbors:
        assert n["cdf_end"] - n["cdf_start"] == pytest.approx(float(probs[n["token_id"]]), abs=1e-6)
