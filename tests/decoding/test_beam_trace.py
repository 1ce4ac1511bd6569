"""decoding/beam.py's record of a search (beam_trace), on a toy model with a fixed log-probability table.

The record must be the search itself: recording changes no hypothesis; each step's running continuations are the
next step's beams, in order; continuations are ranked by cumulative log-probability; a continuation ranked above
the last one kept is pruned only because it ended; every final hypothesis is a continuation marked finished.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tokenriver.decoding.beam import BeamSearch
from tokenriver.errors import InvalidParameterError
from tokenriver.outputs import TokenLogprobs
from tokenriver.params import SamplingParams

EOS = 0
VOCAB_SIZE = 6
MAX_NEW_TOKENS = 5
WIDTH = 3


def table(context: tuple[int, ...]) -> list[TokenLogprobs]:
    """A fixed function of the context: every next token with its log-probability, best first."""
    generator = torch.Generator().manual_seed(hash(context) % 1_000_003)
    logprobs = (torch.randn(VOCAB_SIZE, generator=generator) * 2).log_softmax(dim=0).tolist()
    order = sorted(range(VOCAB_SIZE), key=lambda t: -logprobs[t])
    return [TokenLogprobs(t, logprobs[t], rank) for rank, t in enumerate(order, start=1)]


def search(**options) -> BeamSearch:
    params = SamplingParams(beam_width=WIDTH, n=WIDTH, max_tokens=MAX_NEW_TOKENS, **options)
    ids = itertools.count(1)
    beam_search = BeamSearch(params, "root", lambda: f"beam{next(ids)}", [EOS], MAX_NEW_TOKENS)
    while not beam_search.is_done:
        beam_search.step({beam.request_id: table((5, *beam.token_ids)) for beam in beam_search.running})
    return beam_search


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_recording_changes_no_hypothesis(early_stopping):
    plain = search(early_stopping=early_stopping)
    traced = search(early_stopping=early_stopping, beam_trace=True)
    assert plain.steps == []
    assert [(h.token_ids, h.score, h.finish_reason) for h in traced.best(WIDTH)] == [
        (h.token_ids, h.score, h.finish_reason) for h in plain.best(WIDTH)
    ]


def test_each_step_records_who_runs_on_finishes_or_is_pruned():
    beam_search = search(beam_trace=True)
    steps = beam_search.steps
    assert [s.index for s in steps] == list(range(len(steps)))
    assert [s.is_last for s in steps] == [False] * (len(steps) - 1) + [True]
    for step, following in zip(steps, steps[1:]):
        running = [c for c in step.continuations if c.fate == "running"]
        assert [c.next_beam_index for c in running] == list(range(len(running)))
        assert [(b.token_ids, b.cumulative_logprob) for b in following.beams] == [
            (step.beams[c.beam_index].token_ids + [c.token_id], c.cumulative_logprob) for c in running
        ]
    for step in steps:
        continuations = step.continuations
        assert [c.rank for c in continuations] == list(range(1, len(continuations) + 1))
        assert [c.cumulative_logprob for c in continuations] == sorted(
            (c.cumulative_logprob for c in continuations), reverse=True
        )
        for c in continuations:
            assert c.cumulative_logprob == step.beams[c.beam_index].cumulative_logprob + c.logprob
        running = [c for c in continuations if c.fate == "running"]
        assert len(running) <= WIDTH
        last_kept = max((c.rank for c in running), default=0)
        for c in continuations:
            ends = c.token_id == EOS or len(step.beams[c.beam_index].token_ids) + 1 >= MAX_NEW_TOKENS
            if c.rank < last_kept and c.fate != "running":
                assert ends, "a continuation above the last kept one may only be left out because it ended"
    fates = {c.fate for s in steps for c in s.continuations}
    assert fates == {"running", "finished", "pruned"}
    finished = [
        (s.beams[c.beam_index].token_ids + [c.token_id], c.cumulative_logprob)
        for s in steps
        for c in s.continuations
        if c.fate == "finished"
    ]
    for hypothesis in beam_search.finished:
        assert (hypothesis.token_ids, hypothesis.cumulative_logprob) in finished


def test_beam_trace_needs_a_beam_search():
    with pytest.raises(InvalidParameterError) as refused:
        SamplingParams(beam_trace=True)
    assert refused.value.param == "beam_trace"
    with pytest.raises(InvalidParameterError) as refused:
        SamplingParams(beam_width=2, beam_trace="yes")
    assert refused.value.param == "beam_trace"
