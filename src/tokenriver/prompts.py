"""The one check of a prompt's token ids, shared by every entry point (LLM, EngineCore, the server).

A prompt is refused for the same reasons and in the same words wherever it comes in; the scheduler, which may be
handed a request without the engine (its tests drive it alone), runs the length rules through the same function
(`check_prompt_length`). Errors name the field the caller's user wrote (`param`) and where in it the prompt sits
(`where`, e.g. "prompt[1]"). Stdlib only.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenriver.errors import ContextLengthError, InvalidParameterError


def check_prompt(
    token_ids: Sequence[object],
    vocab_size: int,
    max_model_len: int,
    *,
    max_tokens: int | None = None,
    where: str = "prompt",
    param: str = "prompt",
    max_tokens_param: str = "max_tokens",
    is_pooling: bool = False,
) -> list[int]:
    """token_ids as a list, if it is a non-empty list of ids inside the vocabulary that leaves the context room for
    one generated token (for max_tokens of them when given; an input to embed or score may fill the context);
    else InvalidParameterError / ContextLengthError."""
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise InvalidParameterError(
            f"{where} must be a list of token ids (integers), not {type(token_ids).__name__}", param=param
        )
    ids = list(token_ids)
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidParameterError(
            f"{where} holds token id {bad[0]!r}, outside the vocabulary (integers 0..{vocab_size - 1})", param=param
        )
    num_tokens = len(ids)
    check_prompt_length(num_tokens, max_model_len, where=where, param=param, is_pooling=is_pooling)
    if max_tokens is not None and num_tokens + max_tokens > max_model_len:
        raise ContextLengthError(
            f"this model's context holds {max_model_len} tokens, but you asked for {num_tokens + max_tokens} "
            f"({num_tokens} in {where} + {max_tokens_param}={max_tokens}); shorten the prompt or lower "
            f"{max_tokens_param}",
            num_tokens=num_tokens + max_tokens,
            max_tokens=max_model_len,
            param=max_tokens_param,
        )
    return ids


def check_prompt_length(
    num_tokens: int, max_model_len: int, *, where: str = "prompt", param: str = "prompt", is_pooling: bool = False
) -> None:
    """The rules on a prompt's length alone: at least one token, and inside the context, leaving room for one
    generated token unless the prompt is embedded or scored. InvalidParameterError / ContextLengthError."""
    if num_tokens == 0:
        raise InvalidParameterError(f"{where} is empty: give at least one token", param=param)
    if num_tokens > max_model_len or (num_tokens == max_model_len and not is_pooling):
        room = "" if is_pooling else " (and at least one must be generated)"
        raise ContextLengthError(
            f"this model's context holds {max_model_len} tokens, but {where} has {num_tokens} tokens{room}; shorten "
            f"it, or raise the engine's max_model_len",
            num_tokens=num_tokens,
            max_tokens=max_model_len,
            param=param,
        )


def check_pooling_length(
    num_tokens: int,
    max_num_batched_tokens: int,
    num_pool_tokens: int,
    *,
    where: str = "prompt",
    param: str = "prompt",
) -> None:
    """An input to embed or score runs whole in one forward pass: it must fit one step's token budget and the KV
    pool. The scheduler refuses such a request with it, and the server before queueing one. ContextLengthError."""
    limit, name, remedy = min(
        (max_num_batched_tokens, "max_num_batched_tokens", "raise max_num_batched_tokens (--max-num-batched-tokens)"),
        (num_pool_tokens, "the KV pool's tokens", "give the KV pool more room (--kv-cache-memory)"),
    )
    if num_tokens > limit:
        raise ContextLengthError(
            f"{where} has {num_tokens} tokens, but one forward pass takes at most {limit} ({name}) and an "
            f"embedding or score is computed in one pass: shorten it, or {remedy}",
            num_tokens=num_tokens,
            max_tokens=limit,
            param=param,
        )
