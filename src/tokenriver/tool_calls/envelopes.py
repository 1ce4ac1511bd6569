"""The envelope a tool call is written in, per format: its markers, and finished or unfinished output → calls.

What parses here is what the grammars (tool_calls/grammar.py) let through: prose, then calls with only
whitespace between and after them. Output outside that shape (cut short by max_tokens, or generated without a
grammar) is content, whole: no text is dropped because it sat next to a call.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from tokenriver.outputs import ToolCall

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# How a generic envelope's reply begins (the grammar writes JSON with this spacing).
RESPONSE_OPEN = '{"response": "'
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# Llama 3 separates parallel calls with ";" (its template's convention); whitespace may follow.
LLAMA3_SEPARATOR = ";"


def new_call(name: str, arguments: Any) -> ToolCall:
    """A call with a fresh OpenAI-style id; arguments as JSON text."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name, arguments=text)


def _call_from(data: Any, key: str) -> ToolCall | None:
    if isinstance(data, dict) and isinstance(data.get("name"), str) and key in data:
        return new_call(data["name"], data[key])
    return None


# ----- generic: one JSON object, {"tool_calls": [...]} or {"response": "..."} -------------------------------


def partial_response(text: str) -> str | None:
    """The reply of a generic envelope `{"response": "...` so far (cut short by max_tokens, or still streaming);
    an escape sequence not yet complete is left out."""
    if not text.startswith(RESPONSE_OPEN):
        return None
    body = text[len(RESPONSE_OPEN) - 1 :]  # from the string's opening quote
    for cut in range(min(7, len(body))):
        try:
            value = json.loads(body[: len(body) - cut] + '"')
        except ValueError:
            continue
        return value if isinstance(value, str) else None
    return None


def parse_generic(text: str) -> tuple[str | None, list[ToolCall]]:
    try:
        data = json.loads(text)
    except ValueError:
        partial = partial_response(text)
        return (partial, []) if partial is not None else (text, [])
    if isinstance(data, dict) and isinstance(data.get("response"), str):
        return data["response"], []
    raw_calls = data.get("tool_calls") if isinstance(data, dict) else None
    if isinstance(data, dict) and "tool_call" in data:
        raw_calls = [data["tool_call"]]
    calls = [_call_from(item, "arguments") for item in raw_calls] if isinstance(raw_calls, list) else []
    if not calls or None in calls:
        return text, []
    return None, calls


# ----- hermes: prose, then <tool_call>\n{json}\n</tool_call> … -----------------------------------------------


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    envelopes = text[start:]
    calls = []
    for body in _HERMES_CALL.findall(envelopes):
        try:
            call = _call_from(json.loads(body), "arguments")
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    if not calls or _HERMES_CALL.sub("", envelopes).strip():
        return text, []  # a call cut short, or text between or after the calls
    content = text[:start].rstrip()
    return content or None, calls


def visible_hermes(text: str) -> str:
    start = text.find(HERMES_OPEN)
    end = start if start >= 0 else len(text) - partial_suffix(text, HERMES_OPEN)
    return text[:end].rstrip()  # whitespace before a call is not part of the content


# ----- llama3: prose, or [<|python_tag|>]{json}[; {json}…] -----------------------------------------------------


def parse_llama3(text: str) -> tuple[str | None, list[ToolCall]]:
    stripped = text.strip()
    if stripped.startswith(PYTHON_TAG):
        stripped = stripped[len(PYTHON_TAG) :].strip()
    if not stripped.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls, position = [], 0
    while True:
        try:
            data, position = decoder.raw_decode(stripped, position)
        except ValueError:
            return text, []
        call = _call_from(data, "parameters") or _call_from(data, "arguments")
        if call is None:
            return text, []
        calls.append(call)
        rest = stripped[position:].lstrip()
        if not rest:
            return None, calls
        if not rest.startswith(LLAMA3_SEPARATOR):
            return text, []
        position = len(stripped) - len(rest[1:].lstrip())


def visible_llama3(text: str) -> str:
    stripped = text.lstrip()
    if stripped.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(stripped):
        return ""
    return text


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that begins marker (text that may still become marker)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
