"""Token-level stop conditions, checked after each token appended to a request.

Checked in this order, first match wins:
1. the token is in stop_token_ids (once len(output) >= min_tokens) → STOP, stop_reason = the token id;
2. the token is a model EOS id, unless ignore_eos (once len(output) >= min_tokens) → STOP, stop_reason None;
3. len(output) >= max_tokens → LENGTH;
4. num_tokens >= max_num_tokens (the context is full) → LENGTH: the request ends rather than overrun it.
A stop token that is also the max_tokens-th token therefore reports STOP: the model did stop.

Stop *strings* need text, so the engine checks them after detokenizing and calls
`Scheduler.finish_request`. Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenriver.outputs import FinishReason
from tokenriver.sched.request import Request


@dataclass(frozen=True)
class StopDecision:
    """Why a request must stop now."""

    reason: FinishReason
    # The stop token id that matched; None for EOS and length.
    stop_reason: int | None = None


def check_stop(request: Request, max_num_tokens: int) -> StopDecision | None:
    """Whether the request's last appended token ends it; max_num_tokens is the longest sequence allowed."""
    params = request.sampling_params
    num_output_tokens = request.num_output_tokens
    last_token_id = request.output_token_ids[-1]
    if num_output_tokens >= params.min_tokens:
        if last_token_id in params.stop_token_ids:
            return StopDecision(FinishReason.STOP, last_token_id)
        if not params.ignore_eos and last_token_id in request.eos_token_ids:
            return StopDecision(FinishReason.STOP)
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return StopDecision(FinishReason.LENGTH)
    if request.num_tokens >= max_num_tokens:
        return StopDecision(FinishReason.LENGTH)
    return None
