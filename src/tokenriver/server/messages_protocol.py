"""The wire format of Anthropic's Messages API: pydantic models of its requests, responses and stream events.

Requests are strict and closed like the OpenAI ones (protocol.py): a field this server does not know is refused
naming it, since ignoring it could change the answer unnoticed. Fields a real client (Claude Code, the anthropic
SDK) sends that cannot change what this server generates are declared, type-checked and then ignored; they are
listed in `IGNORED_FIELDS` (and docs/serving.md). A string where the API allows "a string or a list of blocks"
(`system`, a message's `content`, a tool result's `content`) is read as one text block, so each holds a list.

Content blocks share one model, `ContentBlock`, checked per `type`: one model keeps pydantic's error locations
plain (`messages[0].content[1]`), where a tagged union would put the tag into them. Blocks this server cannot
read (images, documents) are refused there with a message saying so.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tokenriver.server.protocol import Int64, Request, Response

# Request fields accepted and ignored: they cannot change what this server generates.
IGNORED_FIELDS: tuple[str, ...] = (
    "metadata",
    "service_tier",
    "context_management",
    "container",
    "output_config.effort",
    "cache_control",
    "inference_geo",
    "speed",
    "thinking.budget_tokens",
    "thinking.display",
)

# Fields each content block type may carry besides `type` (required ones first in the tuple pair).
_BLOCK_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "text": (("text",), ("cache_control", "citations")),
    "tool_use": (("id", "name", "input"), ("cache_control", "caller", "toolset_name")),
    "tool_result": (("tool_use_id",), ("content", "is_error", "cache_control")),
    "thinking": (("thinking",), ("signature",)),
    "redacted_thinking": (("data",), ()),
}
# Blocks a text-only model cannot read, and what to send instead.
_UNREADABLE_BLOCKS: dict[str, str] = {
    "image": "images are not supported: this server runs a text-only model; describe the image in a text block",
    "document": "documents are not supported: this server reads text blocks only; send the document's text",
}


def _as_text_blocks(value: object) -> object:
    """A plain string stands for one text block."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class CacheControl(Request):
    """Anthropic's prompt-caching breakpoint: accepted and ignored (this server caches every prefix)."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class ContentBlock(Request):
    """One block of a message: text, tool_use, tool_result, thinking or redacted_thinking."""

    type: str
    text: str | None = None
    # Text blocks echoed back with citations: accepted and ignored.
    citations: list[Any] | None = None
    # tool_use: the call's id, the tool's name, its input (a JSON object).
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # Echoed back from Anthropic's own responses (who made the call, which toolset it came from): ignored.
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None
    # tool_result: which call it answers, its output (text blocks), whether the tool failed.
    tool_use_id: str | None = None
    content: list[ContentBlock] | None = None
    is_error: bool | None = None
    # thinking / redacted_thinking: what a reasoning model thought (the signature is not checked).
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_kind(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        kind = data.get("type")
        if isinstance(kind, str) and kind in _UNREADABLE_BLOCKS:
            raise PydanticCustomError("unsupported_block", _UNREADABLE_BLOCKS[kind])
        if not isinstance(kind, str) or kind not in _BLOCK_FIELDS:
            raise PydanticCustomError(
                "block_type",
                "content block type '{kind}' is not supported; use text, tool_use, tool_result, thinking or "
                "redacted_thinking",
                {"kind": kind},
            )
        required, optional = _BLOCK_FIELDS[kind]
        missing = [name for name in required if data.get(name) is None]
        if missing:
            raise PydanticCustomError(
                "block_fields", "a {kind} block needs {fields}", {"kind": kind, "fields": ", ".join(missing)}
            )
        foreign = [
            name for name in data if name != "type" and name not in required + optional and name in cls.model_fields
        ]
        if foreign:
            raise PydanticCustomError(
                "block_fields",
                "a {kind} block has no field {fields}",
                {"kind": kind, "fields": ", ".join(repr(name) for name in foreign)},
            )
        if kind == "tool_result" and "content" in data:
            return {**data, "content": _as_text_blocks(data["content"])}
        return data


class InputMessage(Request):
    """One turn of the conversation. Claude Code also sends `system` turns between the others."""

    role: Literal["user", "assistant", "system"]
    content: list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _read_string(cls, value: object) -> object:
        return _as_text_blocks(value)


class TextBlock(Request):
    """A block of the system prompt."""

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class Tool(Request):
    """A tool the model may call (`input_schema` is its JSON schema), or one of Anthropic's server tools
    (a `type` such as `web_search_20250305`, with fields of its own), which this server cannot run."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    # Grammar enforces every call's input, so strict changes nothing; eager_input_streaming is a streaming detail.
    strict: bool | None = None
    eager_input_streaming: bool | None = None
    cache_control: CacheControl | None = None

    @property
    def is_server_tool(self) -> bool:
        return self.type not in (None, "custom")


class ToolChoice(Request):
    """auto: the model decides; any: it must call a tool; tool: it must call the named one; none: no tools."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _check_name(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise PydanticCustomError(
                "tool_choice_name", 'name goes with type "tool" (and only there): the tool the model must call'
            )
        return self


class ThinkingConfig(Request):
    """enabled / disabled switch a reasoning model's thinking on or off; adaptive leaves it to the model."""

    type: Literal["enabled", "disabled", "adaptive"]
    # Not enforced: max_tokens bounds the thinking and the answer together.
    budget_tokens: Int64 | None = Field(default=None, ge=1)
    # Anthropic may summarize or omit the thinking it returns; here it is always returned whole.
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _check_budget(self) -> ThinkingConfig:
        if self.type == "enabled" and self.budget_tokens is None:
            raise PydanticCustomError("thinking_budget", 'type "enabled" needs budget_tokens')
        return self


class OutputFormat(Request):
    """output_config.format: the answer must be JSON that validates against `schema`."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Request):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(Request):
    user_id: str | None = None


class CountTokensRequest(Request):
    """POST /v1/messages/count_tokens: what shapes the prompt."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # MCP connectors run by Anthropic's servers: accepted only empty.
    mcp_servers: list[dict[str, Any]] | None = None
    context_management: dict[str, Any] | None = None
    container: str | dict[str, Any] | None = None
    cache_control: CacheControl | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _read_string(cls, value: object) -> object:
        return _as_text_blocks(value)

    @field_validator("mcp_servers")
    @classmethod
    def _check_mcp_servers(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value:
            raise PydanticCustomError(
                "mcp_servers", "this server cannot connect to MCP servers; send the tools themselves in tools"
            )
        return value


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    # An upper bound: generation also stops where the context is full (stop_reason "max_tokens").
    max_tokens: Int64
    stream: bool | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None


# ----- responses ------------------------------------------------------------------------------------


class TextOut(Response):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(Response):
    type: Literal["thinking"] = "thinking"
    thinking: str
    # Anthropic signs its thinking so it can be checked when sent back; there is nothing to sign here.
    signature: str = ""


class ToolUseOut(Response):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


OutputBlock = TextOut | ThinkingOut | ToolUseOut


class MessagesUsage(Response):
    """Anthropic's counts: input_tokens excludes the prompt tokens read from the prefix cache."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessagesResponse(Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutputBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessagesUsage


class CountTokensResponse(Response):
    input_tokens: int


# ----- stream events ----------------------------------------------------------------------------------


class MessageStartEvent(Response):
    type: Literal["message_start"] = "message_start"
    message: MessagesResponse


class PingEvent(Response):
    type: Literal["ping"] = "ping"


class ContentBlockStartEvent(Response):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: OutputBlock


class TextDelta(Response):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(Response):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDelta(Response):
    type: Literal["signature_delta"] = "signature_delta"
    signature: str


class InputJsonDelta(Response):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(Response):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class ContentBlockStopEvent(Response):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopInfo(Response):
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None


class MessageDeltaEvent(Response):
    """The stop reason, and the usage counts as totals (the SDK overwrites message_start's with them)."""

    type: Literal["message_delta"] = "message_delta"
    delta: StopInfo
    usage: MessagesUsage


class MessageStopEvent(Response):
    type: Literal["message_stop"] = "message_stop"


class AnthropicErrorInfo(Response):
    type: str
    message: str


class AnthropicErrorResponse(Response):
    """An error in Anthropic's shape: the body of an error status, and the data of a stream's `error` event."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


StreamEvent = (
    MessageStartEvent
    | PingEvent
    | ContentBlockStartEvent
    | ContentBlockDeltaEvent
    | ContentBlockStopEvent
    | MessageDeltaEvent
    | MessageStopEvent
    | AnthropicErrorResponse
)
