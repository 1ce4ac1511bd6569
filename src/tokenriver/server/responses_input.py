"""A Responses request's JSON → the validated request and its input items → chat messages.

`parse_responses_request` refuses a top-level field it does not know, with a 400 naming it. The input items and
the tools stay plain JSON in the parsed request and are validated one by one (`validated`), so that an error
names the place the client wrote (`input[2].content`, `tools[1].tools[0].name`), not a pydantic union branch.

Input items become chat messages (ChatMessage's shape):
- a user, system or developer message stays one message; a tool's output becomes a tool message.
- adjacent assistant items (message, function_call, custom_tool_call, reasoning) make one assistant turn.
  Reasoning text rides along as the turn's reasoning_content, which the chat path (like chat completions) does
  not render. A call names its function as the model sees it (`chat_name`: `namespace.name`), and a custom
  tool's input becomes the arguments `{"input": "..."}`.
- each chat message keeps the Responses field it came from (`ChatMessages.sources`: `input[2]`; `input` for an
  assistant turn joined from several items), so that a chat error about `messages[k]` can name it.

A `type` is looked up in a table only once it is known to be a string: any other value is a 400 naming it.

Instructions and a previous response's conversation are joined in by the planner (responses_plan); this module
knows nothing of the store, the tools' definitions or the engine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from tokenriver.errors import InvalidParameterError
from tokenriver.server.protocol import json_object
from tokenriver.server.responses_protocol import (
    IGNORED_FIELDS,
    INPUT_ITEM_MODELS,
    NON_TEXT_PARTS,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)

# Parameter names from pydantic's error locations: field names, not the names of union members.
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_UNION_MEMBER_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """Bytes of a JSON body → a validated request; an unknown top-level field is a 400 naming it."""
    data = json_object(body)
    unknown = [key for key in data if key not in ResponsesRequest.model_fields]
    if unknown:
        raise InvalidParameterError(
            f"unknown field(s) {', '.join(map(repr, unknown))}: tokenriver does not implement them, and ignoring "
            f"them could change the result unnoticed; remove them (fields accepted and ignored: "
            f"{', '.join(IGNORED_FIELDS)})",
            param=unknown[0],
        )
    return ResponsesRequest.model_validate(data)


def validated(model: type[BaseModel], value: object, where: str) -> Any:
    """value as `model`; a pydantic error becomes an InvalidParameterError naming the place under `where`."""
    try:
        return model.model_validate(value)
    except ValidationError as error:
        # A union reports one error per member; the deepest one is about the member the client meant.
        problem = max(error.errors(), key=lambda e: len(e["loc"]))
        param = where + "".join(
            f"[{part}]" if isinstance(part, int) else f".{part}"
            for part in problem["loc"]
            if isinstance(part, int) or (_FIELD_NAME.fullmatch(part) and part not in _UNION_MEMBER_NAMES)
        )
        message = f"{param} is required" if problem["type"] == "missing" else f"{param}: {problem['msg']}"
        raise InvalidParameterError(message, param=param) from None


def parse_input_items(value: str | list[Any] | None) -> list[InputItem]:
    """The request's input as items: a string is one user message."""
    if value is None:
        return []
    if isinstance(value, str):
        return [MessageItem(role="user", content=value)]
    return [_input_item(raw, f"input[{index}]") for index, raw in enumerate(value)]


def _input_item(raw: object, where: str) -> InputItem:
    if not isinstance(raw, dict):
        raise InvalidParameterError(f"{where} must be an input item (an object with a type)", param=where)
    kind = raw.get("type", "message" if "role" in raw else None)
    model = INPUT_ITEM_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise InvalidParameterError(
            f"{where}.type={kind!r} is not an input item tokenriver takes; send one of {', '.join(INPUT_ITEM_MODELS)}",
            param=f"{where}.type",
        )
    parts_field = "content" if kind == "message" else "output"
    _check_parts(raw.get(parts_field), f"{where}.{parts_field}")
    item = validated(model, raw, where)
    if isinstance(item, FunctionCallItem):
        _check_json(item.arguments, f"{where}.arguments")
    return item


def _check_parts(parts: object, where: str) -> None:
    """Refuse content parts that are not text (NON_TEXT_PARTS), naming them; a part's `type` must be a string
    before the table is asked about it."""
    for index, part in enumerate(parts if isinstance(parts, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind is not None and not isinstance(kind, str):
            param = f"{where}[{index}].type"
            raise InvalidParameterError(f"{param} must be a string, not {type(kind).__name__}", param=param)
        if kind in NON_TEXT_PARTS:
            raise InvalidParameterError(NON_TEXT_PARTS[kind], param=where)


def _check_json(text: str, where: str) -> None:
    try:
        json.loads(text)
    except RecursionError:
        raise InvalidParameterError(f"{where} nests JSON too deeply; send a flatter value", param=where) from None
    except ValueError:
        raise InvalidParameterError(f"{where} must be JSON text (got {text[:60]!r})", param=where) from None


def chat_name(name: str, namespace: str | None) -> str:
    """The function name the model sees for a tool (or a call in the history)."""
    return name if namespace is None else f"{namespace}.{name}"


@dataclass
class ChatMessages:
    """Chat messages (ChatMessage's shape), and for each the Responses field it came from."""

    messages: list[dict[str, Any]]
    # The field each message came from: `input[2]`, `instructions`, or `input` where it joins several items.
    sources: list[str]

    def with_first(self, message: dict[str, Any], source: str) -> ChatMessages:
        """These messages with `message` put first."""
        return ChatMessages([message, *self.messages], [source, *self.sources])


def chat_messages(items: list[InputItem], item_sources: list[str] | None = None) -> ChatMessages:
    """Input items as chat messages; adjacent assistant items make one assistant turn. item_sources: the field
    each item came from (by default `input[i]`, the item's index)."""
    sources = item_sources if item_sources is not None else [f"input[{index}]" for index in range(len(items))]
    chat = ChatMessages([], [])
    for item, source in zip(items, sources, strict=True):
        if isinstance(item, MessageItem) and item.role != "assistant":
            chat.messages.append({"role": item.role, "content": item.text()})
            chat.sources.append(source)
        elif isinstance(item, FunctionCallOutputItem):
            chat.messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            chat.sources.append(source)
        else:
            _add_to_assistant_turn(_assistant_turn(chat, source), item)
    return chat


def _assistant_turn(chat: ChatMessages, source: str) -> dict[str, Any]:
    """The assistant turn the next assistant item joins (a new one after any other message)."""
    if not chat.messages or chat.messages[-1]["role"] != "assistant":
        chat.messages.append({"role": "assistant", "content": None})
        chat.sources.append(source)
    elif chat.sources[-1] != source:
        # Joined from several items: no one item is the place of an error about the turn.
        chat.sources[-1] = "input"
    return chat.messages[-1]


def _add_to_assistant_turn(turn: dict[str, Any], item: InputItem) -> None:
    if isinstance(item, MessageItem):
        turn["content"] = _joined(turn["content"], item.text())
    elif isinstance(item, ReasoningItem):
        turn["reasoning_content"] = _joined(turn.get("reasoning_content"), item.text())
    else:
        arguments = item.arguments if isinstance(item, FunctionCallItem) else json.dumps({"input": item.input})
        call = {"id": item.call_id, "type": "function", "function": {"name": chat_name(item.name, item.namespace)}}
        call["function"]["arguments"] = arguments
        turn.setdefault("tool_calls", []).append(call)


def _joined(first: str | None, second: str) -> str:
    return second if not first else f"{first}\n{second}"
