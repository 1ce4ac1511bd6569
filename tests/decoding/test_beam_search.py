"""decoding/beam.py without an engine: a toy model with a fixed log-probability table.

A beam wide enough to hold every prefix, with early_stopping="never", must find
exactly what enumerating every sequence finds (the best n by
sum_logprobs / length ** length_penalty). Narrow beams are checked on a table
where greedy decoding goes wrong, on what each beam needs to report per step,
and on the stopping rules.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tokenriver.decoding.beam import BeamSearch, num_candidates_per_beam
from tokenriver.outputs import FinishReason, TokenLogprobs
from tokenriver.params import SamplingParams

EOS = 0


def toy_logprobs(context: tuple[int, ...], vocab_size: int) -> list[float]:
    """A fixed function of the context: the log-probabilities of the next token."""
    generator = torch.Generator().manual_seed(hash(context) % 1_000_003)
    return (torch.randn(vocab_size, generator=generator) * 2).log_softmax(dim=0).tolist()


def candidates_of(context: tuple[int, ...], vocab_size: int, num_top: int | None = None) -> list[TokenLogprobs]:
    logprobs = toy_logprobs(context, vocab_size)
    order = sorted(range(vocab_size), key=lambda t: -logprobs[t])[:num_top]
    return [TokenLogprobs(t, logprobs[t], rank) for rank, t in enumerate(order, start=1)]


def run_beam_search(
    params: SamplingParams,
    vocab_size: int,
    max_new_tokens: int,
    prompt: tuple[int, ...] = (5,),
    num_top: int | None = None,
    table=candidates_of,
    stop_token_ids=(EOS,),
) -> BeamSearch:
    ids = itertools.count(1)
    search = BeamSearch(params, "root", lambda: f"beam{next(ids)}", list(stop_token_ids), max_new_tokens)
    while not search.is_done:
        candidates = {
            beam.request_id: table(prompt + tuple(beam.token_ids), vocab_size, num_top) for beam in search.running
        }
        search.step(candidates)
    return search


def brute_force(
    vocab_size: int, max_new_tokens: int, length_penalty: float, min_tokens: int = 0, prompt: tuple[int, ...] = (5,)
) -> list[tuple[float, tuple[int, ...]]]:
    """Every sequence that ends at EOS or at max_new_tokens, with its score, best first."""
    results = []

    def walk(tokens: tuple[int, ...], total: float) -> None:
        logprobs = toy_logprobs(prompt + tokens, vocab_size)
        for token in range(vocab_size):
            if token == EOS and len(tokens) < min_tokens:
                continue
            sequence, score = tokens + (token,), total + logprobs[token]
            if token == EOS or len(sequence) == max_new_tokens:
                results.append((score / len(sequence) ** length_penalty, sequence))
            else:
                walk(sequence, score)

    walk((), 0.0)
    return sorted(results, reverse=True)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0, -0.5])
@pytest.mark.parametrize("min_tokens", [0, 2])
def test_a_wide_beam_finds_what_enumeration_finds(length_penalty, min_tokens):
    vocab_size, max_new_tokens = 4, 4
    params = SamplingParams(
        beam_width=64,
        n=3,
        length_penalty=length_penalty,
        early_stopping="never",
        min_tokens=min_tokens,
        max_tokens=max_new_tokens,
    )
    search = run_beam_search(params, vocab_size, max_new_tokens)
    expected = brute_force(vocab_size, max_new_tokens, length_penalty, min_tokens)[:3]
    best = search.best(3)
    assert [tuple(h.token_ids) for h in best] == [sequence for _, sequence in expected]
    assert [h.score for h in best] == pytest.approx([score for score, _ in expected], abs=1e-9)
    for hypothesis in best:
        assert hypothesis.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in hypothesis.logprobs))
        ends_at_eos = hypothesis.token_ids[-1] == EOS
        assert hypothesis.finish_reason == (FinishReason.STOP if ends_at_eos else FinishReason.LENGTH)


def crafted_table(context: tuple[int, ...], vocab_size: int, num_top: int | None = None) -> list[TokenLogprobs]:
    """Greedy takes 1 (0.6) and then only finds 0.1-probability tokens; 2 (0.4) leads to a 0.9 token."""
    generated = context[1:]
    if not generated:
        probs = {1: 0.6, 2: 0.4}
    elif len(generated) == 1:
        probs = {EOS: 0.05, 3: 0.05, 4: 0.9} if generated == (2,) else {EOS: 0.1, 3: 0.45, 4: 0.45}
    else:
        probs = {EOS: 1.0}
    table = {t: probs.get(t, 1e-9) for t in range(vocab_size)}
    order = sorted(table, key=lambda t: -table[t])[:num_top]
    return [TokenLogprobs(t, math.log(table[t]), rank) for rank, t in enumerate(order, start=1)]


def test_two_beams_beat_greedy_on_a_crafted_table():
    params = SamplingParams(beam_width=2, length_penalty=0.0, max_tokens=3)
    (best,) = run_beam_search(params, 6, 3, table=crafted_table).best(1)
    assert best.token_ids == [2, 4, EOS]
    assert best.cumulative_logprob == pytest.approx(math.log(0.4 * 0.9))
    (greedy,) = run_beam_search(
        SamplingParams(beam_width=1, length_penalty=0.0, max_tokens=3), 6, 3, table=crafted_table
    ).best(1)
    assert greedy.token_ids[0] == 1


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_each_beam_reporting_its_top_tokens_is_enough(early_stopping):
    """Candidates cut to num_candidates_per_beam per beam give the same search as the whole vocabulary."""
    vocab_size = 60
    params = SamplingParams(beam_width=3, n=3, length_penalty=1.0, early_stopping=early_stopping, max_tokens=8)
    num_top = num_candidates_per_beam(params, [EOS])
    full = run_beam_search(params, vocab_size, 8, prompt=(7, 8))
    cut = run_beam_search(params, vocab_size, 8, prompt=(7, 8), num_top=num_top)
    assert [(h.token_ids, h.score) for h in cut.best(3)] == [(h.token_ids, h.score) for h in full.best(3)]


def test_early_stopping_true_ends_once_width_hypotheses_exist():
    def eos_heavy(context, vocab_size, num_top=None):
        table = {EOS: 0.5, 1: 0.3, 2: 0.2}
        return [TokenLogprobs(t, math.log(p), r) for r, (t, p) in enumerate(table.items(), start=1)]

    params = SamplingParams(beam_width=2, n=2, early_stopping=True, max_tokens=50)
    search = run_beam_search(params, 3, 50, table=eos_heavy)
    assert len(search.finished) == 2 and search.num_generated < 5
    assert all(h.finish_reason is FinishReason.STOP and h.stop_reason is None for h in search.finished)


def test_max_tokens_finishes_every_beam_with_length():
    params = SamplingParams(beam_width=2, n=2, max_tokens=3, ignore_eos=True)
    search = run_beam_search(params, 10, 3, stop_token_ids=())
    assert [len(h.token_ids) for h in search.best(2)] == [3, 3]
    assert all(h.finish_reason is FinishReason.LENGTH for h in search.best(2))
