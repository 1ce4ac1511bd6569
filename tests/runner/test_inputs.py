"""runner/inputs.py on plain scheduling data: the ragged batch prepare_inputs makes of a SchedulerOutput, and the
next pass advance_decode derives from a pass of one-token decodes."""

from __future__ import annotations

import pytest
import torch

from tokenriver.params import SamplingParams
from tokenriver.runner.inputs import advance_decode, prepare_inputs
from tokenriver.sched.output import ScheduledRequest, SchedulerOutput

BLOCK_SIZE = 4


def _request(
    request_id: str,
    token_ids: list[int],
    start: int,
    blocks: list[int],
    sample: bool = True,
    prompt: list[int] | None = None,
    **options,
) -> ScheduledRequest:
    params = options.pop("params", SamplingParams(max_tokens=8))
    return ScheduledRequest(
        request_id, token_ids, start, blocks, sample, params, prompt if prompt is not None else token_ids, [], **options
    )


def _slot(blocks: list[int], position: int) -> int:
    return blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


def test_a_mixed_step_is_flattened_in_batch_order():
    chunk = _request("chunk", [11, 12, 13, 14, 15], 0, [7, 2], sample=False, prompt=list(range(11, 20)))
    decode = _request("decode", [21], 6, [3, 9])
    drafts = _request("drafts", [31], 5, [4, 5], draft_token_ids=[32, 33])
    beam = _request("beam", [41], 3, [6], num_beam_candidates=2)
    inputs = prepare_inputs(SchedulerOutput([chunk, decode, drafts, beam]), BLOCK_SIZE, "cpu")

    assert inputs.input_ids.tolist() == [11, 12, 13, 14, 15, 21, 31, 32, 33, 41]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 6, 5, 6, 7, 3]
    metadata = inputs.metadata
    assert metadata.query_lens == [5, 1, 3, 1] and metadata.seq_lens == [5, 7, 8, 4]
    assert metadata.slot_mapping.tolist() == (
        [_slot([7, 2], p) for p in range(5)]
        + [_slot([3, 9], 6)]
        + [_slot([4, 5], p) for p in (5, 6, 7)]
        + [_slot([6], 3)]
    )
    assert metadata.block_tables.tolist() == [[7, 2], [3, 9], [4, 5], [6, 0]]  # padded with block 0
    # The chunk does not reach its last known token: nothing to sample. The decode samples its one row; the
    # drafts request scores its last known token and all but its last draft; the beam reports candidates.
    assert [r.request_id for r in inputs.sampling_requests] == ["decode"] and inputs.sample_rows == [5]
    assert [r.request_id for r in inputs.draft_requests] == ["drafts"] and inputs.draft_rows == [[6, 7, 8]]
    assert [r.request_id for r in inputs.beam_requests] == ["beam"] and inputs.beam_rows == [9]


def test_prompt_logprob_rows_score_the_next_prompt_token():
    prompt = [50, 51, 52, 53, 54, 55]
    params = SamplingParams(max_tokens=4, prompt_logprobs=2)
    first = _request("a", prompt[:4], 0, [1, 2], sample=False, prompt=prompt, params=params)
    rest = _request("b", prompt[4:], 4, [3, 4], prompt=prompt, params=params)
    inputs = prepare_inputs(SchedulerOutput([first, rest]), BLOCK_SIZE, "cpu")
    entry_a, entry_b = inputs.prompt_logprob_rows
    # Row p predicts prompt token p + 1; the prompt's last position predicts a generated token, not scored here.
    assert (entry_a.rows, entry_a.next_token_ids, entry_a.num_top) == ([0, 1, 2, 3], [51, 52, 53, 54], 2)
    assert (entry_b.rows, entry_b.next_token_ids) == ([4], [55])


def test_advance_decode_moves_every_request_one_position_on():
    # The scheduler took the blocks of every pass of the step: position 3 ends block 8, position 4 starts block 12.
    first = _request("a", [5], 3, [8, 12])
    second = _request("b", [6], 9, [1, 2, 3])
    inputs = prepare_inputs(SchedulerOutput([first, second]), BLOCK_SIZE, "cpu")
    assert inputs.metadata.slot_mapping.tolist() == [8 * BLOCK_SIZE + 3, _slot([1, 2, 3], 9)]
    following = advance_decode(inputs, [70, 71], BLOCK_SIZE, "cpu")
    assert following.input_ids.tolist() == [70, 71]
    assert following.positions.tolist() == [4, 10]
    assert following.metadata.seq_lens == [5, 11] and following.metadata.query_lens == [1, 1]
    assert following.metadata.slot_mapping.tolist() == [12 * BLOCK_SIZE, _slot([1, 2, 3], 10)]
    assert following.sampling_requests == inputs.sampling_requests and following.sample_rows == [0, 1]


def test_advance_decode_takes_the_token_ids_on_the_device_as_they_are():
    inputs = prepare_inputs(
        SchedulerOutput([_request("a", [5], 2, [8]), _request("b", [6], 0, [9])]), BLOCK_SIZE, "cpu"
    )
    sampled = torch.tensor([40, 41])
    assert advance_decode(inputs, sampled, BLOCK_SIZE, "cpu").input_ids is sampled


@pytest.mark.parametrize(
    "step",
    [
        [_request("chunk", [1, 2, 3], 0, [1])],  # a prompt chunk
        [_request("a", [1], 4, [1, 2]), _request("b", [2], 4, [3, 4], sample=False)],  # a row that does not sample
        [_request("drafts", [1], 4, [1, 2], draft_token_ids=[5])],
        [_request("beam", [1], 4, [1, 2], num_beam_candidates=2)],
    ],
)
def test_advance_decode_refuses_anything_but_sampled_one_token_decodes(step):
    inputs = prepare_inputs(SchedulerOutput(step), BLOCK_SIZE, "cpu")
    with pytest.raises(ValueError, match="one-token decodes"):
        advance_decode(inputs, [9] * len(step), BLOCK_SIZE, "cpu")
