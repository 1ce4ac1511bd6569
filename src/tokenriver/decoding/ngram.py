"""N-gram proposer (prompt lookup decoding): drafts copied from earlier in the same request.

If the request's last n tokens occurred before, guess that what followed them
then follows them now. Longer matches are tried first (ngram_max down to
ngram_min) and the most recent earlier occurrence wins. No model and no
state: the guess is a deterministic function of the request's tokens, so the
acceptance rule sees a point mass (Proposal.probs is None).

It shines when the output repeats the input: rewriting or editing a given
text, refactoring code, answering with quotes. On open chat it rarely
matches, and then it proposes nothing, so the step is a plain decode.
"""

from __future__ import annotations

from array import array

from tokenriver.decoding.proposer import Proposal
from tokenriver.sched.request import Request

# Token ids as 4-byte items: bytes.rfind then does the search in C.
_ITEM_SIZE = array("i").itemsize


def find_continuation(token_ids: list[int], ngram_min: int, ngram_max: int, max_num_tokens: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the longest matching suffix (at most
    max_num_tokens of them; [] when no suffix of ngram_min..ngram_max tokens occurred before)."""
    num_tokens = len(token_ids)
    if max_num_tokens < 1:
        return []
    data = array("i", token_ids).tobytes()
    for n in range(min(ngram_max, num_tokens - 1), ngram_min - 1, -1):
        pattern = data[-n * _ITEM_SIZE :]
        # An occurrence must start before the suffix itself does, so that at least one token follows it.
        end = len(data) - _ITEM_SIZE
        start = data.rfind(pattern, 0, end)
        while start != -1 and start % _ITEM_SIZE:
            # A match that straddles two token ids: look further left.
            start = data.rfind(pattern, 0, start + len(pattern) - 1)
        if start != -1:
            follow = start // _ITEM_SIZE + n
            return token_ids[follow : follow + max_num_tokens]
    return []


class NgramProposer:
    """Prompt lookup: the Proposer that needs no model."""

    # It runs no forward pass (decoding/proposer.py).
    num_forward_passes = 0

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, requests: list[Request], max_num_tokens: list[int]) -> list[Proposal | None]:
        proposals: list[Proposal | None] = []
        for request, limit in zip(requests, max_num_tokens):
            token_ids = find_continuation(request.all_token_ids, self.ngram_min, self.ngram_max, limit)
            proposals.append(Proposal(token_ids) if token_ids else None)
        return proposals

    def drop(self, request_ids: list[str]) -> None:
        """Nothing is kept per request."""
