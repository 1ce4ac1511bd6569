"""What the engine records for the visualizer's look inside: beam search's steps (SamplingParams.beam_trace →
RequestOutput.beam_steps) and the names of a draw's neighbouring tokens, with the default numerics.

Recording changes no beam, and every returned beam is one the record shows: a beam of some step with the token
that finished it there (or, when the search stopped before enough finished, a beam still running at the end).
"""

from __future__ import annotations

import pytest

from tokenriver.engine.llm import LLM
from tokenriver.params import SamplingParams

PROMPTS = [
    "The three primary colors are",
    # A chat turn the model often ends with <|im_end|>: hypotheses that stop at EOS.
    "<|im_start|>user\nReply with one word: yes or no. Is water wet?<|im_end|>\n<|im_start|>assistant\n",
]
BEAMS = dict(beam_width=3, n=3, max_tokens=10)


@pytest.fixture(scope="module")
def llm(loaded_default) -> LLM:
    return LLM.from_loaded(loaded_default)


def test_beam_trace_records_the_search_and_changes_no_beam(llm):
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.encode(p)} for p in PROMPTS]
    plain = llm.generate(prompts, SamplingParams(**BEAMS), use_tqdm=False)
    traced = llm.generate(prompts, SamplingParams(**BEAMS, beam_trace=True), use_tqdm=False)
    for without, output in zip(plain, traced):
        assert without.beam_steps is None
        assert [(c.token_ids, c.cumulative_logprob, c.beam_score, c.text) for c in output.outputs] == [
            (c.token_ids, c.cumulative_logprob, c.beam_score, c.text) for c in without.outputs
        ]
        steps = output.beam_steps
        assert steps and steps[-1].is_last and not any(s.is_last for s in steps[:-1])
        kept = {
            (tuple(s.beams[c.beam_index].token_ids + [c.token_id]), c.cumulative_logprob)
            for s in steps
            for c in s.continuations
            if c.fate != "pruned"
        }
        for candidate in output.outputs:
            assert (tuple(candidate.token_ids), candidate.cumulative_logprob) in kept
        for step in steps:
            assert [b.text for b in step.beams] == [tokenizer.decode(b.token_ids) for b in step.beams]
            assert [c.text for c in step.continuations] == [
                tokenizer.token_text(c.token_id) for c in step.continuations
            ]


def test_a_sampled_steps_draw_names_its_neighbours(llm):
    """The sampler records the draw's neighbouring spans by id; the engine gives each its text, as for candidates."""
    tokenizer = llm.get_tokenizer()
    (output,) = llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=0.8, seed=3, max_tokens=4, trace=True), use_tqdm=False
    )
    for step in output.outputs[0].trace:
        neighbors = step.extra["draw"]["neighbors"]
        assert step.chosen_token_id in [n["token_id"] for n in neighbors]
        assert [n["text"] for n in neighbors] == [tokenizer.token_text(n["token_id"]) for n in neighbors]
