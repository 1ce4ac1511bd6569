"""Logits processors: pure tensor → tensor functions, one per sampling control.

Each function takes a batch of logits `[N, V]` and the control's value for
every row as an `[N]` tensor, so rows with different parameters are processed
in one vectorized call. Contract shared by all of them:

- The input is never modified; a new tensor is always returned.
- A row whose control is off (penalty 1, bias absent, temperature 1, top_k 0,
  top_p 1, min_p 0, ...) comes back bit-for-bit unchanged.
- Removing a token means setting its logit to -inf.
- Ragged per-row token id lists travel as `[N, L]` int64 tensors padded with
  `vocab_size` (see `pad_token_ids`); every function ignores that padding id.

Semantics follow the references the tests compare against: transformers'
RepetitionPenalty/Temperature/TopK/TopP/MinP processors and OpenAI's
presence/frequency penalty formula. The sampler decides the order in which
they run and which rows each one sees; this module knows nothing about
requests or SamplingParams.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Top-p first looks for its cut among the most likely `size` tokens, growing `size` only for rows not decided yet:
# most real distributions hold top_p of their mass within a few hundred tokens, and a full sort of a batch of
# vocabulary-wide rows costs about twenty times their top-256.
TOP_P_SEARCH_SIZES: tuple[int, ...] = (256, 4096)


def pad_token_ids(rows: list[list[int]], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Ragged id lists → one `[N, max_len]` tensor padded with `vocab_size`, the id every processor ignores."""
    max_len = max((len(ids) for ids in rows), default=0)
    padded = [ids + [vocab_size] * (max_len - len(ids)) for ids in rows]
    return torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(rows), max_len)  # [N, max_len]


def count_tokens(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each vocabulary id occurs in each row of `token_ids` ([N, L], padded with vocab_size).

    One scatter_add into an [N, V + 1] tensor: the extra column absorbs the padding (and any id beyond the
    vocabulary, as transformers does for embeddings larger than the output layer) and is dropped.
    """
    num_rows = token_ids.shape[0]
    ids = token_ids.clamp(max=vocab_size)  # [N, L]
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int32, device=token_ids.device)  # [N, V + 1]
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab_size]  # [N, V]


def apply_repetition_penalty(logits: torch.Tensor, token_ids: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' repetition penalty: a token seen before gets logit / p if positive, logit * p if negative.

    `token_ids` [N, L] holds the prompt and generated tokens (padded with vocab_size); `penalty` [N] (1 = off,
    > 1 discourages). Like transformers, only the seen entries are touched (gather, penalize, scatter back; a
    repeated id writes the same value twice), which costs O(L) instead of a dense pass over the vocabulary.
    """
    vocab_size = logits.shape[1]
    ids = token_ids.clamp(max=vocab_size)  # [N, L]
    padded = F.pad(logits, (0, 1))  # [N, V + 1]: the padding id lands in the extra column
    seen = padded.gather(1, ids)  # [N, L]
    row_penalty = penalty.to(logits.dtype).unsqueeze(1)  # [N, 1]
    padded.scatter_(1, ids, torch.where(seen < 0, seen * row_penalty, seen / row_penalty))
    return padded[:, :vocab_size].contiguous()  # [N, V]


def apply_presence_frequency_penalties(
    logits: torch.Tensor, output_token_ids: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """OpenAI's penalties over generated tokens only: logit[j] -= count[j] * frequency + (count[j] > 0) * presence.

    `output_token_ids` [N, L] holds the generated tokens (padded with vocab_size); `presence`, `frequency`: [N]
    (0 = off). Tokens never generated are unchanged, so only the generated ids are gathered, penalized and
    scattered back, each with its count from `count_tokens`.
    """
    vocab_size = logits.shape[1]
    ids = output_token_ids.clamp(max=vocab_size)  # [N, L]
    counts = count_tokens(ids, vocab_size)  # [N, V]
    # The padding's count is read from a real column, but its result goes to the dropped extra column.
    generated_counts = counts.gather(1, ids.clamp(max=vocab_size - 1)).to(logits.dtype)  # [N, L], all >= 1
    penalty = generated_counts * frequency.to(logits.dtype).unsqueeze(1) + presence.to(logits.dtype).unsqueeze(1)
    padded = F.pad(logits, (0, 1))  # [N, V + 1]: the padding id lands in the extra column
    padded.scatter_(1, ids, padded.gather(1, ids) - penalty)
    return padded[:, :vocab_size].contiguous()  # [N, V]


def apply_logit_bias(logits: torch.Tensor, token_ids: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    """Add `biases[i, m]` to the logit of `token_ids[i, m]` ([N, M] each, ids padded with vocab_size).

    A bias of -100 makes a token practically impossible without forcing it to -inf (OpenAI's meaning).
    """
    is_real = token_ids < logits.shape[1]  # [N, M], False on padding
    rows = torch.arange(logits.shape[0], device=logits.device).unsqueeze(1).expand_as(token_ids)  # [N, M]
    biased = logits.clone()
    biased.index_put_((rows[is_real], token_ids[is_real]), biases[is_real].to(logits.dtype), accumulate=True)
    return biased


def apply_min_tokens(
    logits: torch.Tensor, blocked_ids: torch.Tensor, num_output_tokens: torch.Tensor, min_tokens: torch.Tensor
) -> torch.Tensor:
    """Forbid the ids in `blocked_ids` ([N, M], padded with vocab_size: EOS and stop token ids) while a row has
    generated fewer than `min_tokens` tokens, so it cannot end early. `num_output_tokens`, `min_tokens`: [N].
    """
    is_too_short = (num_output_tokens < min_tokens).unsqueeze(1)  # [N, 1]
    is_blocked = (blocked_ids < logits.shape[1]) & is_too_short  # [N, M], False on padding
    rows = torch.arange(logits.shape[0], device=logits.device).unsqueeze(1).expand_as(blocked_ids)  # [N, M]
    blocked = logits.clone()
    blocked[rows[is_blocked], blocked_ids[is_blocked]] = float("-inf")
    return blocked


def allows(mask: torch.Tensor, token_id: int) -> bool:
    """Whether a grammar bitmask ([W] int32) allows token_id: one word read, no unpacking."""
    return token_id < 32 * mask.shape[0] and bool((int(mask[token_id // 32]) >> (token_id % 32)) & 1)


def allowed_tokens(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack grammar bitmasks ([N, W] int32, bit i of word w allows token 32 * w + i) into [N, vocab_size] bool.
    Tokens past the mask's 32 * W bits are not allowed."""
    bits = torch.arange(32, dtype=torch.int32, device=masks.device)  # [32]
    allowed = ((masks.unsqueeze(2) >> bits) & 1).bool().reshape(masks.shape[0], -1)  # [N, 32 * W]
    if allowed.shape[1] < vocab_size:
        allowed = F.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return allowed[:, :vocab_size]


def apply_allowed_tokens(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Remove every token a row's grammar does not allow (allowed: [N, V] bool)."""
    return logits.masked_fill(~allowed, float("-inf"))


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature ([N], > 0; greedy rows, temperature 0, are the sampler's business)."""
    return logits / temperature.to(logits.dtype).unsqueeze(1)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the k largest logits of each row (transformers: ties with the k-th are kept).

    `top_k` [N]: <= 0 or >= V turns it off for that row.
    """
    vocab_size = logits.shape[1]
    is_on = (top_k > 0) & (top_k < vocab_size)  # [N]
    if not bool(is_on.any()):
        return logits.clone()
    k = torch.where(is_on, top_k, torch.ones_like(top_k)).to(torch.int64)  # [N]
    largest = logits.topk(int(k.max()), dim=1).values  # [N, max_k], descending
    kth_value = largest.gather(1, (k - 1).unsqueeze(1))  # [N, 1]
    kth_value = kth_value.masked_fill(~is_on.unsqueeze(1), float("-inf"))  # rows that are off: nothing is below
    return torch.where(logits < kth_value, float("-inf"), logits)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability adds up to >= top_p ([N], 1 = off).

    transformers' rule, stated from the top: a token is kept while the mass ranked strictly above it is below
    top_p, so the most likely token always survives. Tokens tied with the least likely kept one are all kept
    (transformers keeps whichever its sort happened to put first).
    """
    num_rows, vocab_size = logits.shape
    probs = logits.softmax(dim=1)  # [N, V]
    # Per row, the probability of the least likely kept token; 0 keeps the whole row.
    min_kept_prob = torch.zeros(num_rows, 1, dtype=probs.dtype, device=probs.device)  # [N, 1]
    pending = torch.nonzero(top_p < 1).squeeze(1)  # [n] rows whose cut is not found yet
    for size in (*TOP_P_SEARCH_SIZES, vocab_size):
        if pending.numel() == 0:
            break
        size = min(size, vocab_size)
        sorted_probs = probs[pending].topk(size, dim=1).values  # [n, size], descending
        cumulative = sorted_probs.cumsum(dim=1)  # [n, size]
        mass_above = F.pad(cumulative[:, :-1], (1, 0))  # [n, size]: mass ranked strictly above each token
        row_top_p = top_p[pending].to(probs.dtype).unsqueeze(1)  # [n, 1]
        # [n, 1]; at least 1 even when top_p underflows to 0 in the logits' dtype.
        num_kept = (mass_above < row_top_p).sum(dim=1, keepdim=True).clamp_(min=1)
        # Decided: the `size` most likely tokens already hold top_p (everything below is cut), or the row is sorted.
        is_decided = (cumulative[:, -1:] >= row_top_p).squeeze(1) | (size == vocab_size)  # [n]
        min_kept_prob[pending[is_decided]] = sorted_probs.gather(1, num_kept - 1)[is_decided]
        pending = pending[~is_decided]
    return torch.where(probs < min_kept_prob, float("-inf"), logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability ([N], 0 = off)."""
    probs = logits.softmax(dim=1)  # [N, V]
    threshold = min_p.to(probs.dtype).unsqueeze(1) * probs.amax(dim=1, keepdim=True)  # [N, 1]
    return torch.where(probs < threshold, float("-inf"), logits)
