"""The grammars that enforce tool calls (llguidance's Lark dialect, or a JSON schema for the generic format).

"required" and a named function: the output is calls only. "auto": the output is prose, or prose and then
calls: a lazy grammar that leaves the model free until the envelope opens, then enforces the call body with the
JSON schema of the callable tools, then allows more calls (when parallel) or whitespace and the end. Text after
the calls is refused rather than lost when the output is parsed.

An envelope marker the vocabulary holds as one special token (Llama 3's `<|python_tag|>`, an added `<tool_call>`)
is not text to the grammar engine: the grammar names it by id (`<[id]>`), and the free text before it cannot
spell it. A marker that is plain text is matched as text, through a lazy lexeme that ends at the marker
(llguidance's tool-calling pattern, as in its StructTag).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tokenriver.params import JSON_LAYOUT, StructuredOutput
from tokenriver.tool_calls.envelopes import HERMES_CLOSE, HERMES_OPEN, LLAMA3_SEPARATOR, PYTHON_TAG

# Any text (a regex over valid UTF-8; special tokens are not text and never match it).
_ANY_TEXT = "/(?s:.*)/"
_WHITESPACE = "[ \\t\\r\\n]"
# Optional whitespace: between calls, and after the last one (a template may end a call with a newline).
_SPACE = "WS?"

SpecialTokenId = Callable[[str], "int | None"]


def generic_grammar(call: dict[str, Any], is_auto: bool, is_parallel: bool) -> StructuredOutput:
    """One JSON object: `{"tool_calls": [...]}`, or with auto also `{"response": "..."}`."""
    calls: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not is_parallel:
        calls["maxItems"] = 1
    envelope: dict[str, Any] = {
        "type": "object",
        "properties": {"tool_calls": calls},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    if is_auto:
        response = {
            "type": "object",
            "properties": {"response": {"type": "string"}},
            "required": ["response"],
            "additionalProperties": False,
        }
        envelope = {"anyOf": [envelope, response]}
    return StructuredOutput.json(envelope)


def hermes_grammar(
    call: dict[str, Any], is_auto: bool, is_parallel: bool, special_token_id: SpecialTokenId
) -> StructuredOutput:
    """`<tool_call>\\n{json}\\n</tool_call>`, several separated by whitespace when parallel."""
    opening, closing = _marker(HERMES_OPEN, special_token_id), _marker(HERMES_CLOSE, special_token_id)
    calls = f"body ({_SPACE} {opening} body)* {_SPACE}" if is_parallel else f"body {_SPACE}"
    rules = [f'body: "\\n" %json {_json(call)} "\\n" {closing}']
    if not is_auto:
        rules.insert(0, f"start: {opening} {calls}")
    elif opening.startswith("<["):
        rules[:0] = [f"start: PROSE | PROSE {opening} {calls}", f"PROSE: {_ANY_TEXT}"]
    else:
        # PROSE cannot hold the marker, so prose-only output cannot hide a malformed call; `opening` is one
        # lexeme, ended (lazily) by the marker, after which the body is enforced.
        rules[:0] = [
            f"start: PROSE | opening {calls}",
            f"PROSE: {_ANY_TEXT} & ~/(?s:.*){_escape_regex(HERMES_OPEN)}(?s:.*)/",
            f"opening[lazy]: PROSE {opening}",
        ]
    return _lark(rules)


def llama3_grammar(
    call: dict[str, Any], is_auto: bool, is_parallel: bool, special_token_id: SpecialTokenId
) -> StructuredOutput:
    """`{"name": ..., "parameters": {...}}`, after `<|python_tag|>` or not; `;` between parallel calls. With auto,
    prose is any output that starts (after whitespace) with neither `{` nor the tag."""
    if not is_auto:
        return StructuredOutput.json({**call, "x-guidance": JSON_LAYOUT})
    tag = _marker(PYTHON_TAG, special_token_id)
    prose = f"/{_WHITESPACE}*/ | /{_WHITESPACE}*[^{{ \\t\\r\\n](?s:.*)/"
    if not tag.startswith("<["):
        prose = f"({prose}) & ~/{_WHITESPACE}*{_escape_regex(PYTHON_TAG)}(?s:.*)/"
    separator = json.dumps(LLAMA3_SEPARATOR)
    calls = f"call ({_SPACE} {separator} {_SPACE} call)* {_SPACE}" if is_parallel else f"call {_SPACE}"
    return _lark(
        [f"start: PROSE | {_SPACE} ({tag} {_SPACE})? {calls}", f"PROSE: {prose}", f"call: %json {_json(call)}"]
    )


def _lark(rules: list[str]) -> StructuredOutput:
    return StructuredOutput.grammar("\n".join(["%llguidance {}", *rules, f"WS: /{_WHITESPACE}+/"]) + "\n")


def _marker(text: str, special_token_id: SpecialTokenId) -> str:
    """The marker in the grammar: `<[id]>` when the vocabulary holds it as one special token, else a string."""
    token_id = special_token_id(text)
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


def _json(schema: dict[str, Any]) -> str:
    return json.dumps({**schema, "x-guidance": JSON_LAYOUT})


def _escape_regex(text: str) -> str:
    """text as a literal inside a Lark /regex/ (Rust regex syntax; `/` closes the regex)."""
    return "".join("\\" + char if char in "\\.+*?()|[]{}^$#&-~/" else char for char in text)
