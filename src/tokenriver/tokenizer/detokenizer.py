"""IncrementalDetokenizer: generated token ids -> text deltas, one step at a time.

Decoding each new token alone is wrong in two ways: a SentencePiece token loses its leading space
("▁Paris" alone decodes to "Paris"), and a character split over several byte tokens decodes to U+FFFD
until its last byte arrives. vLLM's answer, used here: keep two offsets into the recent token ids,

    ids:  ... [prefix_offset ............ read_offset ....... end]
               \\__ already emitted, kept as context __/\\__ new __/

decode `ids[prefix_offset:read_offset]` and `ids[prefix_offset:]`, and emit what the second adds to the first.
The context tokens make spaces come out as they do inside the full text. While the new decode ends in
U+FFFD (an incomplete UTF-8 character), nothing is emitted and the offsets stay, so the character comes
out whole once complete. The first step uses the prompt's last tokens as context.

Invariant: the concatenation of all deltas (plus `flush()`) equals `tokenizer.decode(prompt + generated)`
minus `tokenizer.decode(prompt)`, which is `tokenizer.decode(generated)` for byte-level tokenizers. It differs
from `decode(generated)` in one documented case: a SentencePiece decoder strips the space it prepended to the
*whole text*, so `decode(generated)` alone drops the space that separates the first generated word from the
prompt, while the stream keeps it (" Paris" after "The capital is"), as vLLM's does.
"""

from __future__ import annotations

from tokenriver.tokenizer.tokenizer import Tokenizer

# Prompt tokens decoded along with the first generated ones (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_NUM_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of one request's generated tokens, streamed as deltas that never split a character."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The window starts at prefix_offset: older ids never influence a delta again, so they are dropped.
        self._window = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        # Index in the window of the first token whose text was not emitted yet.
        self._read_offset = len(self._window)
        # decode(window[:read_offset]): the context text the next delta is measured against.
        self._prefix_text = self._decode(self._window)
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append generated tokens; return the text they complete (may be "" while a character is unfinished)."""
        deltas = []
        for token_id in token_ids:
            self._window.append(token_id)
            new_text = self._decode(self._window)
            # vLLM's rule: wait while nothing visible was added (a skipped special token) or while the text
            # ends in U+FFFD (a character still missing bytes); otherwise emit what the window gained.
            if len(new_text) > len(self._prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
                deltas.append(self._emit(new_text))
        delta = "".join(deltas)
        self._text += delta
        return delta

    def flush(self) -> str:
        """Release text held back because it ends in U+FFFD (generation ended inside a broken character).

        Call once when the request finishes; the held bytes then show as U+FFFD, as a full decode shows them.
        """
        if self._read_offset == len(self._window):
            return ""
        delta = self._emit(self._decode(self._window))
        self._text += delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _emit(self, new_text: str) -> str:
        """Everything in the window is now emitted; its unread tokens become the next step's context."""
        delta = new_text[len(self._prefix_text) :]
        self._window = self._window[self._read_offset :]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta
