"""SchedulerOutput → tensors: the only place where plain scheduling data becomes model input.

The batch is ragged: the tokens of all scheduled requests are concatenated in
batch order (no padding), each with its absolute position; a request's draft
tokens (speculative decoding) follow its known tokens. `sample_rows` are the
flat rows whose logits feed the sampler (the last token of each request that
samples this step); `draft_rows` hold, per request with drafts, the rows of its
last known token and of every draft but the last: row j predicts the token after
draft j, so the target scores all drafts (and one more token) in this one pass.
`beam_rows` are the last-token rows of beam-search requests, which report their
most likely next tokens instead of sampling. `prompt_logprob_rows` are the rows
whose logits score the next prompt token (only for requests that asked for
prompt logprobs). `pooling_rows` are the row ranges of pooling requests' whole
prompts, whose final hidden states are pooled instead of sampled. `advance_decode`
derives a multi-step step's next pass from the one before: every request one
position on, fed the token it sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenriver.models.attention_metadata import AttentionMetadata, to_device
from tokenriver.sched.output import ScheduledRequest, SchedulerOutput


@dataclass
class PromptLogprobRows:
    """Rows of one request whose logits score prompt tokens this step."""

    request_id: str
    # Flat token rows whose logits predict the next prompt token.
    rows: list[int]
    # The prompt token each row predicts.
    next_token_ids: list[int]
    num_top: int


@dataclass
class ModelInputs:
    """One forward pass worth of tensors plus where to read the logits."""

    # [num_tokens] int64
    input_ids: torch.Tensor
    # [num_tokens] int64
    positions: torch.Tensor
    metadata: AttentionMetadata
    # Requests that sample this step, in the order of `sample_rows`.
    sampling_requests: list[ScheduledRequest]
    # Flat rows of their last tokens.
    sample_rows: list[int]
    prompt_logprob_rows: list[PromptLogprobRows] = field(default_factory=list)
    # Requests that verify draft tokens this step, in the order of `draft_rows`.
    draft_requests: list[ScheduledRequest] = field(default_factory=list)
    # Per draft request, 1 + len(draft_token_ids) consecutive flat rows: its last known token and its drafts.
    draft_rows: list[list[int]] = field(default_factory=list)
    # Beam-search requests that reached their last token, and the flat row of that token.
    beam_requests: list[ScheduledRequest] = field(default_factory=list)
    beam_rows: list[int] = field(default_factory=list)
    # Pooling requests, and per request the flat rows of its whole prompt (first row, number of rows).
    pooling_requests: list[ScheduledRequest] = field(default_factory=list)
    pooling_rows: list[tuple[int, int]] = field(default_factory=list)


def prepare_inputs(output: SchedulerOutput, block_size: int, device: torch.device | str) -> ModelInputs:
    """Flatten the scheduled requests into one ragged batch."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    block_tables: list[list[int]] = []
    sampling_requests: list[ScheduledRequest] = []
    sample_rows: list[int] = []
    prompt_rows: list[PromptLogprobRows] = []
    draft_requests: list[ScheduledRequest] = []
    draft_rows: list[list[int]] = []
    beam_requests: list[ScheduledRequest] = []
    beam_rows: list[int] = []
    pooling_requests: list[ScheduledRequest] = []
    pooling_rows: list[tuple[int, int]] = []
    for request in output.scheduled:
        first_row = len(input_ids)
        num_tokens = len(request.token_ids)
        num_scheduled = request.num_scheduled_tokens
        input_ids.extend(request.token_ids)
        input_ids.extend(request.draft_token_ids)
        positions.extend(range(request.start_position, request.start_position + num_scheduled))
        query_lens.append(num_scheduled)
        seq_lens.append(request.start_position + num_scheduled)
        block_tables.append(request.block_ids)
        if request.pooling_params is not None:
            pooling_requests.append(request)
            pooling_rows.append((first_row, num_tokens))
        elif request.sample and request.draft_token_ids:
            draft_requests.append(request)
            draft_rows.append(list(range(first_row + num_tokens - 1, first_row + num_scheduled)))
        elif request.sample and request.num_beam_candidates:
            beam_requests.append(request)
            beam_rows.append(first_row + num_tokens - 1)
        elif request.sample:
            sampling_requests.append(request)
            sample_rows.append(first_row + num_tokens - 1)
        num_top = request.sampling_params.prompt_logprobs
        num_prompt = len(request.prompt_token_ids)
        if num_top is not None and request.start_position < num_prompt - 1:
            # Position p predicts prompt token p + 1; the last prompt position predicts a generated token.
            last = min(request.start_position + num_tokens, num_prompt - 1)
            prompt_rows.append(
                PromptLogprobRows(
                    request_id=request.request_id,
                    rows=[first_row + p - request.start_position for p in range(request.start_position, last)],
                    next_token_ids=request.prompt_token_ids[request.start_position + 1 : last + 1],
                    num_top=num_top,
                )
            )
    return ModelInputs(
        input_ids=to_device(input_ids, device),
        positions=to_device(positions, device),
        metadata=AttentionMetadata.build(query_lens, seq_lens, block_tables, block_size, device),
        sampling_requests=sampling_requests,
        sample_rows=sample_rows,
        prompt_logprob_rows=prompt_rows,
        draft_requests=draft_requests,
        draft_rows=draft_rows,
        beam_requests=beam_requests,
        beam_rows=beam_rows,
        pooling_requests=pooling_requests,
        pooling_rows=pooling_rows,
    )


def advance_decode(
    inputs: ModelInputs, token_ids: list[int] | torch.Tensor, block_size: int, device: torch.device | str
) -> ModelInputs:
    """The next forward pass of a multi-step step (SchedulerOutput.num_decode_passes): each request of `inputs`
    (one token each, every one sampled) computes token_ids[i], one position further. Its slot is in the blocks the
    scheduler took for all of the step's passes (the requests' block_ids). token_ids may be a [B] int64 tensor on
    the device, the pass before's argmax, which then never comes back to the host in between."""
    requests = inputs.sampling_requests
    if (
        len(token_ids) != len(requests)
        or inputs.sample_rows != list(range(len(requests)))
        or inputs.draft_requests
        or inputs.beam_requests
        or inputs.prompt_logprob_rows
        or inputs.pooling_requests
    ):
        raise ValueError("advance_decode continues a batch of one-token decodes that all sample, with one token each")
    return ModelInputs(
        input_ids=token_ids if isinstance(token_ids, torch.Tensor) else to_device(token_ids, device),
        positions=inputs.positions + 1,
        metadata=AttentionMetadata.build(
            [1] * len(requests),
            [n + 1 for n in inputs.metadata.seq_lens],
            [request.block_ids for request in requests],
            block_size,
            device,
        ),
        sampling_requests=requests,
        sample_rows=inputs.sample_rows,
    )
