"""StopStringChecker: cut streamed text at the first stop string, without ever showing part of one.

Text arrives in pieces (detokenizer deltas) that split a stop string anywhere: "<|", "END", "|>". The
checker keeps back only the tail that could still grow into a stop string (the longest suffix of the text
that is a proper prefix of some stop string) and emits everything before it.

"First" means the stop string that is complete earliest in the text (smallest end position; at equal ends
the one that starts earliest). That is the only rule under which the result does not depend on how the
text was split into pieces: streamed token by token, generation stops the moment any stop string is
complete. On a match the text ends right before the stop string (or right after it with
`include_stop_str_in_output`) and later input is ignored.

Invariant, for any split of a text into pieces: the concatenation of everything returned by `process`
and `flush` equals the text cut at the first stop string, and no character of a cut stop string is returned.
"""

from __future__ import annotations

from tokenriver.errors import InvalidParameterError


class StopStringChecker:
    """Stop-string state of one request's text stream."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool) -> None:
        for index, stop_string in enumerate(stop):
            if not isinstance(stop_string, str) or not stop_string:
                raise InvalidParameterError(
                    f"stop[{index}]={stop_string!r} is invalid: each stop string must be a non-empty string.",
                    param="stop",
                )
        self._stop = list(dict.fromkeys(stop))
        self._include_stop = include_stop_str_in_output
        # Every proper prefix of every stop string: the tails worth holding back.
        self._prefixes = {s[:length] for s in self._stop for length in range(1, len(s))}
        self._max_held = max((len(s) - 1 for s in self._stop), default=0)
        self._held = ""
        self._text = ""
        self._matched: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    def process(self, delta: str) -> tuple[str, str | None]:
        """Feed the next piece of text; return (text safe to emit now, the stop string that matched or None)."""
        if self._matched is not None:
            return "", None
        pending = self._held + delta
        match = self._first_match(pending)
        if match is not None:
            start, stop_string = match
            end = start + len(stop_string) if self._include_stop else start
            self._held = ""
            self._matched = stop_string
            return self._emit(pending[:end]), stop_string
        num_held = self._num_held(pending)
        self._held = pending[len(pending) - num_held :]
        return self._emit(pending[: len(pending) - num_held]), None

    def flush(self) -> str:
        """Release the held-back tail: generation ended for another reason, so it cannot become a stop string."""
        held, self._held = self._held, ""
        return self._emit(held)

    def _emit(self, text: str) -> str:
        self._text += text
        return text

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the occurrence that ends first, ties going to the earliest start."""
        best: tuple[int, int, str] | None = None
        for stop_string in self._stop:
            start = text.find(stop_string)
            if start < 0:
                continue
            key = (start + len(stop_string), start, stop_string)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _num_held(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for length in range(min(len(text), self._max_held), 0, -1):
            if text[-length:] in self._prefixes:
                return length
        return 0
