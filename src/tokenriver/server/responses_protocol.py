"""The wire format of OpenAI's Responses API: the request, its input items and tools, the response and its events.

Parsed as strictly as the chat API (protocol.py): closed models, no coercion. Two parts of a request stay plain
JSON in `ResponsesRequest` and are validated one by one in responses_input.py and responses_tools.py, so that an
error names the exact place the client wrote (`input[2].content`, `tools[1].tools[0].name`) rather than a pydantic
union branch: the input items (`INPUT_ITEM_MODELS`, picked by `type`) and the tools (`TOOL_MODELS`; hosted tools
this server cannot run, such as `web_search`, are skipped rather than refused).

Fields that never change the output here are accepted and ignored (`IGNORED_FIELDS`); a field this server does
not know is refused with 400 naming it, because ignoring it could change the answer unnoticed.

Response models follow the openai SDK's `types/responses` (the SDK's stream accumulator checks that item ids,
output indexes and content indexes agree from `response.output_item.added` to `response.completed`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tokenriver.server.protocol import Int64, Request, Response

# Request fields accepted and ignored: they never change what is generated here.
IGNORED_FIELDS: tuple[str, ...] = (
    "user",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    "client_metadata",
    "include",
    "reasoning",
    "top_logprobs",
    "stream_options",
    "max_tool_calls",
)
# `include` values that would ask for something this server cannot return (every other value is ignored).
REFUSED_INCLUDES: tuple[str, ...] = ("message.output_text.logprobs", "message.input_image.image_url")
# Metadata key that lists the tools skipped because this server cannot run them (comma-separated types).
SKIPPED_TOOLS_KEY = "tokenriver_skipped_tools"


def _omit_none() -> Any:
    """A field left out of the JSON when None (an optional field of OpenAI's shape)."""
    return Field(default=None, exclude_if=lambda value: value is None)


# ----- request -----------------------------------------------------------------------------------------


class TextFormat(Request):
    """text.format: free text, any JSON object, or JSON that validates against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # "schema" clashes with a BaseModel attribute.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    # The schema is always enforced by grammar; strict only says the client relies on it.
    strict: bool | None = None


class TextConfig(Request):
    format: TextFormat | None = None
    # A hint to OpenAI's models on answer length: accepted and ignored.
    verbosity: str | None = None


class ToolChoiceFunction(Request):
    type: Literal["function"]
    name: str


class ToolChoiceCustom(Request):
    type: Literal["custom"]
    name: str


class ResponsesRequest(Request):
    """POST /v1/responses."""

    model: str | None = None
    # A user message as a string, or a list of input items (validated one by one: INPUT_ITEM_MODELS).
    input: str | list[Any] | None = None
    # A leading system message; not carried over to a response that names this one as previous_response_id.
    instructions: str | None = None
    # Tool definitions (validated one by one: TOOL_MODELS); hosted tools are skipped.
    tools: list[Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # An upper bound: what does not fit in the context is cut there, and the response is incomplete.
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    # Keep the response (input and output items) so a later request can continue it; off unless true.
    store: bool | None = None
    previous_response_id: str | None = None
    # Echoed in the response (plus SKIPPED_TOOLS_KEY when tools were skipped).
    metadata: dict[str, str] | None = None
    # Only "disabled": an input that does not fit is refused, never cut.
    truncation: Literal["disabled"] | None = None
    # Only false: a response runs while its request is open.
    background: bool | None = None
    # Accepted and ignored (IGNORED_FIELDS); kept so the response can echo them.
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    client_metadata: dict[str, Any] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: Int64 | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: Int64 | None = None


# ----- input items -------------------------------------------------------------------------------------


class InputTextPart(Request):
    type: Literal["input_text"]
    text: str


class OutputTextPart(Request):
    """Assistant text echoed back from an earlier response (its annotations and logprobs are dropped)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalPart(Request):
    type: Literal["refusal"]
    refusal: str


class MessageItem(Request):
    """A message; items without `type` but with `role` are messages too."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputTextPart | OutputTextPart | RefusalPart]
    id: str | None = None
    status: str | None = None
    # Codex marks assistant messages as "commentary" or "final_answer": no effect on the prompt.
    phase: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.refusal if isinstance(part, RefusalPart) else part.text for part in self.content)


class FunctionCallItem(Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    # The arguments as a JSON text.
    arguments: str
    namespace: str | None = None
    id: str | None = None
    status: str | None = None


class CustomToolCallItem(Request):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    namespace: str | None = None
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Request):
    """The result of a function call (`function_call_output`) or of a custom tool call (`custom_tool_call_output`)."""

    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: str | list[InputTextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(part.text for part in self.output)


class ReasoningTextPart(Request):
    type: Literal["reasoning_text", "text"]
    text: str


class SummaryTextPart(Request):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(Request):
    """Thinking returned by an earlier response: its text, else its summary."""

    type: Literal["reasoning"]
    summary: list[SummaryTextPart] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    # OpenAI's opaque thinking: nothing here can read it.
    encrypted_content: str | None = None
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        parts = self.content or self.summary
        return "\n".join(part.text for part in parts)


InputItem = MessageItem | FunctionCallItem | CustomToolCallItem | FunctionCallOutputItem | ReasoningItem

INPUT_ITEM_MODELS: dict[str, type[Request]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "custom_tool_call": CustomToolCallItem,
    "function_call_output": FunctionCallOutputItem,
    "custom_tool_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
# Content part types that carry something other than text.
NON_TEXT_PARTS: dict[str, str] = {
    "input_image": "images are not supported: tokenriver serves text-only models; send input_text parts",
    "input_file": "files are not supported: send the file's text as an input_text part",
    "input_audio": "audio is not supported: send input_text parts",
}


# ----- tools -------------------------------------------------------------------------------------------


class FunctionTool(Request):
    """A function tool in the Responses shape (flat: no nested "function" object)."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    # JSON schema of the arguments (None = no arguments).
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomToolFormat(Request):
    """How a custom tool's free-text input is constrained: not at all ("text"), or by a Lark grammar or a regex."""

    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class CustomTool(Request):
    """A tool whose call carries free text (Codex's apply_patch), constrained by its format when it is forced."""

    type: Literal["custom"]
    name: str = Field(min_length=1)
    description: str | None = None
    format: CustomToolFormat | None = None


class NamespaceTool(Request):
    """Tools grouped under a name (Codex sends MCP servers' tools this way); a call names its namespace."""

    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: str | None = None
    tools: list[dict[str, Any]]


TOOL_MODELS: dict[str, type[Request]] = {"function": FunctionTool, "custom": CustomTool, "namespace": NamespaceTool}


# ----- response ----------------------------------------------------------------------------------------


class OutputText(Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(Response):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputMessage(Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str
    content: list[OutputText]


class OutputReasoning(Response):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    encrypted_content: str | None = None
    status: str | None = None


class OutputFunctionCall(Response):
    id: str
    type: Literal["function_call"] = "function_call"
    status: str
    call_id: str
    name: str
    arguments: str
    namespace: str | None = _omit_none()


class OutputCustomToolCall(Response):
    id: str
    type: Literal["custom_tool_call"] = "custom_tool_call"
    call_id: str
    name: str
    input: str
    namespace: str | None = _omit_none()


OutputItem = OutputMessage | OutputReasoning | OutputFunctionCall | OutputCustomToolCall


class InputTokensDetails(Response):
    # Prompt tokens served from the prefix cache.
    cached_tokens: int = 0
    # OpenAI bills cache writes; the prefix cache keeps computed blocks without a charge, so 0.
    cache_write_tokens: int = 0


class OutputTokensDetails(Response):
    reasoning_tokens: int = 0


class ResponseUsage(Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Response):
    reason: str


class ResponseError(Response):
    code: str
    message: str


class ResponseObject(Response):
    """A response: what POST returns, what the lifecycle events carry, and what GET returns once stored."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    # When the output finished (None while in progress, and for a failed response).
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = False
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[Any] = Field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    top_logprobs: int | None = None


# ----- stream events -----------------------------------------------------------------------------------


class LifecycleEvent(Response):
    """response.created, response.in_progress, response.completed, response.incomplete, response.failed."""

    type: str
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(Response):
    """response.output_item.added and response.output_item.done."""

    type: str
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(Response):
    """response.content_part.added and response.content_part.done."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(Response):
    """response.output_text.delta and response.reasoning_text.delta (which has no logprobs)."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] | None = _omit_none()


class TextDoneEvent(Response):
    """response.output_text.done and response.reasoning_text.done (which has no logprobs)."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] | None = _omit_none()


class CallDeltaEvent(Response):
    """response.function_call_arguments.delta and response.custom_tool_call_input.delta."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class CallDoneEvent(Response):
    """response.function_call_arguments.done (arguments) and response.custom_tool_call_input.done (input)."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str | None = _omit_none()
    input: str | None = _omit_none()


StreamEvent = (
    LifecycleEvent
    | OutputItemEvent
    | ContentPartEvent
    | TextDeltaEvent
    | TextDoneEvent
    | CallDeltaEvent
    | CallDoneEvent
)
