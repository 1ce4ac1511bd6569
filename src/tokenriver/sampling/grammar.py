"""The grammar stage: llguidance matchers that say, per request and step, which tokens may come next.

Two objects:
- `GrammarCompiler` turns a `StructuredOutput` into an llguidance grammar, checks it, and keeps one compiled
  matcher per (kind, text) as a template; requests get deep copies. It is thread-safe so that a request's
  grammar is compiled (and an invalid one refused) in the thread that submits it, not on the engine thread.
- `GrammarMatchers` keeps one matcher per running request and derives its state from the request's token
  history: before each mask (or single-token check) it rolls back to the longest prefix it shares with the
  history, then consumes the rest. Accepted tokens, speculative drafts (consumed, masked, rolled back),
  preemption (the history is kept) and beam forks (a different history) all come out of that one rule.
- `GrammarRow` is one request's grammar at one sampling row, asked lazily: a greedy row whose argmax the
  grammar accepts needs one token checked, not the mask over the whole vocabulary.

Masks are llguidance's bitmask: int32 words, bit i of word w allows token 32 * w + i.
Knows nothing about the scheduler or the model; imports llguidance, not its torch helpers.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tokenriver.errors import InvalidParameterError
from tokenriver.params import JSON_LAYOUT, StructuredOutput
from tokenriver.sampling.processors import allows

if TYPE_CHECKING:
    import llguidance

# Compiled grammars kept (least recently used dropped first).
MAX_CACHED_GRAMMARS = 256


def mask_width(vocab_size: int) -> int:
    """int32 words in one token mask."""
    return (vocab_size + 31) // 32


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of a constraint (not yet checked). A constraint llguidance cannot read (a GBNF grammar
    the converter refuses, a schema nested past its recursion limit, a bad regex) is the caller's error."""
    try:
        return _grammar_text(spec)
    except ValueError as error:
        what = {"json_schema": "JSON schema", "regex": "regex", "choice": "choice"}.get(spec.kind, "grammar")
        raise InvalidParameterError(f"the {what} is invalid: {error}", param="structured_output") from error


def _grammar_text(spec: StructuredOutput) -> str:
    import llguidance  # on first use: most engines never constrain an output

    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides=JSON_LAYOUT)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_LAYOUT)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", spec.text)
    return llguidance.grammar_from("grammar", spec.text)


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: list[int]) -> None:
        # tokenizer_json: makes the tokenizer's Hugging Face `tokenizers` JSON, called on first use (a 262k
        # vocabulary takes a noticeable part of a second to serialize, and most engines never constrain);
        # vocab_size: the model's logits width.
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer_json = tokenizer_json
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._templates: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (it scans every token)."""
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
                )
            return self._tokenizer

    def compile(self, spec: StructuredOutput) -> None:
        """Check the constraint and cache its grammar; raises InvalidParameterError naming the problem.

        A schema keyword llguidance would ignore (it reports those as warnings) is refused too: the output
        would not be guaranteed to validate."""
        self.new_matcher(spec)

    def is_special_token(self, token_id: int) -> bool:
        """Whether the grammar engine sees the token as special rather than as its text (every added token, such
        as Llama 3's `<|python_tag|>` or Qwen 2.5's `<tool_call>`): a grammar names it `<[id]>`, and no text
        rule matches it."""
        return self.tokenizer.is_special_token(token_id)

    def new_matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for the constraint, at the start of the output."""
        key = (spec.kind, spec.text)
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return template.deep_copy()
        import llguidance

        tokenizer = self.tokenizer
        grammar = grammar_text(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error or messages:
            what = {
                "json_schema": "JSON schema",
                "json_object": "JSON schema",
                "regex": "regex",
                "choice": "choice",
                "grammar": "grammar",
            }[spec.kind]
            problem = "; ".join(messages) if messages else "it does not compile"
            raise InvalidParameterError(f"the {what} cannot be enforced: {problem}", param="structured_output")
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidParameterError(
                f"the grammar cannot be enforced: {template.get_error()}", param="structured_output"
            )
        with self._lock:
            self._templates[key] = template
            while len(self._templates) > MAX_CACHED_GRAMMARS:
                self._templates.popitem(last=False)
        return template.deep_copy()


class _Tracked:
    """A request's matcher and the tokens it has consumed."""

    def __init__(self, spec: StructuredOutput, matcher: llguidance.LLMatcher) -> None:
        self.spec = spec
        self.matcher = matcher
        self.consumed: list[int] = []


class GrammarMatchers:
    """One matcher per constrained request, following the request's tokens."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._tracked: dict[str, _Tracked] = {}

    def drop(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)

    def mask(self, request_id: str, spec: StructuredOutput, token_ids: list[int]) -> torch.Tensor | None:
        """The allowed next tokens after `token_ids` (the request's output so far): [W] int32, or None while the
        constraint has not started (spec.starts_after)."""
        masks = self.masks_along(request_id, spec, token_ids, [])[1]
        return masks[0] if masks is not None else None

    def accepts(self, request_id: str, spec: StructuredOutput, token_ids: list[int], token_id: int) -> bool:
        """Whether the grammar allows token_id after `token_ids` (the request's output so far), as its mask
        would say; an allowed token is consumed, so the next step's mask starts from it. Checking one token
        costs a small part of filling the mask over the whole vocabulary."""
        token_ids = list(spec.prefix_token_ids) + token_ids
        start = _start_of_constraint(spec.starts_after, token_ids)
        if start is None:
            return True
        tracked = self._sync(request_id, spec, token_ids[start:])
        matcher = tracked.matcher
        if token_id in self.compiler.eos_token_ids or matcher.is_error():
            # End of sequence is allowed once the grammar is complete, and is all an erring grammar allows.
            return token_id in self.compiler.eos_token_ids and (matcher.is_error() or matcher.is_accepting())
        if matcher.validate_tokens([token_id]) != 1:
            return False
        # Where the grammar forces text, the mask allows only the first token of that text's own tokenization
        # (llguidance's choice: the model stays on the tokenizations it was trained on); other valid splits of
        # the same text are refused, as the mask refuses them.
        # (Forced bytes are asked first: far cheaper than their tokens, and usually none.)
        forced = matcher.compute_ff_tokens() if matcher.compute_ff_bytes() else []
        if forced and forced[0] != token_id:
            return False
        matcher.consume_token(token_id)
        tracked.consumed.append(token_id)
        return True

    def masks_along(
        self, request_id: str, spec: StructuredOutput, token_ids: list[int], draft_token_ids: list[int]
    ) -> tuple[int, torch.Tensor | None]:
        """Masks after the output and after each draft the grammar allows: (m, [m + 1, W] int32).

        m counts the leading drafts the grammar accepts; a draft it rejects, and every draft after it, is cut
        (the target could never emit it). The matcher is left after `token_ids` alone. Before the constraint
        starts there are no masks, and the drafts are kept up to the one that would start it. A continued
        generation's earlier output (spec.prefix_token_ids) counts as output here."""
        token_ids = list(spec.prefix_token_ids) + token_ids
        start = _start_of_constraint(spec.starts_after, token_ids)
        if start is None:
            end = _start_of_constraint(spec.starts_after, token_ids + draft_token_ids)
            return (len(draft_token_ids) if end is None else end - len(token_ids)), None
        tracked = self._sync(request_id, spec, token_ids[start:])
        matcher = tracked.matcher
        masks = torch.zeros(len(draft_token_ids) + 1, mask_width(self.compiler.vocab_size), dtype=torch.int32)
        num_valid = 0
        while True:
            self._fill(matcher, masks[num_valid])
            if num_valid == len(draft_token_ids) or not allows(masks[num_valid], draft_token_ids[num_valid]):
                break
            if not matcher.consume_token(draft_token_ids[num_valid]):
                break
            num_valid += 1
        if num_valid and not matcher.rollback(num_valid):
            self._tracked.pop(request_id)
        return num_valid, masks[: num_valid + 1]

    def _fill(self, matcher: llguidance.LLMatcher, row: torch.Tensor) -> None:
        """Write the matcher's next-token mask into row ([W] int32, contiguous). A matcher in its error state
        allows only end of sequence: the request ends rather than continue outside the grammar."""
        if matcher.is_error():
            row.zero_()
            for token_id in self.compiler.eos_token_ids:
                row[token_id // 32] |= _bit(token_id % 32)
            return
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def _sync(self, request_id: str, spec: StructuredOutput, token_ids: list[int]) -> _Tracked:
        """The request's matcher, advanced (or rolled back) to just after `token_ids`."""
        tracked = self._tracked.get(request_id)
        if tracked is not None and tracked.spec != spec:
            tracked = None
        if tracked is not None:
            consumed = len(tracked.consumed)
            # The usual case, a history that only grew, compared in one slice.
            common = (
                consumed if token_ids[:consumed] == tracked.consumed else _common_prefix(tracked.consumed, token_ids)
            )
            excess = len(tracked.consumed) - common
            if excess and not tracked.matcher.rollback(excess):
                tracked = None
            elif excess:
                del tracked.consumed[common:]
        if tracked is None:
            tracked = _Tracked(spec, self.compiler.new_matcher(spec))
            self._tracked[request_id] = tracked
        for token_id in token_ids[len(tracked.consumed) :]:
            # A token the grammar refuses (an EOS it already ended with, or a history from before the
            # constraint) leaves the matcher in its error state, whose mask allows only end of sequence.
            if not tracked.matcher.is_error():
                tracked.matcher.consume_token(token_id)
            tracked.consumed.append(token_id)
        return tracked


class GrammarRow:
    """One request's grammar at one sampling row, asked lazily (sampling/rows.py's LazyGrammar)."""

    def __init__(
        self, matchers: GrammarMatchers, request_id: str, spec: StructuredOutput, token_ids: list[int]
    ) -> None:
        # token_ids: the request's output before this row's token.
        self._matchers = matchers
        self._request_id = request_id
        self._spec = spec
        self._token_ids = token_ids

    def accepts(self, token_id: int) -> bool:
        return self._matchers.accepts(self._request_id, self._spec, self._token_ids, token_id)

    def mask(self) -> torch.Tensor | None:
        return self._matchers.mask(self._request_id, self._spec, self._token_ids)


def _start_of_constraint(starts_after: tuple[int, ...], token_ids: list[int]) -> int | None:
    """Index in token_ids where the constraint starts: just after the first occurrence of starts_after."""
    if not starts_after:
        return 0
    width = len(starts_after)
    for end in range(width, len(token_ids) + 1):
        if tuple(token_ids[end - width : end]) == starts_after:
            return end
    return None


def _bit(index: int) -> int:
    """Bit `index` of an int32 word, as the signed value torch stores."""
    return (1 << index) - (1 << 32 if index == 31 else 0)


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = min(len(a), len(b))
    for i in range(length):
        if a[i] != b[i]:
            return i
    return length
