"""The wire format: pydantic models of OpenAI's requests and responses, plus tokenriver's extensions.

Requests are parsed strictly (a string is not a number, `true` is not 1) and
closed: a field this server does not know is rejected with 400 naming it,
because silently dropping something that changes behaviour would return a
plausible but wrong answer. Two exceptions, listed below, are accepted and
dropped before validation: fields that never change the output
(`IGNORED_FIELDS`), and unsupported OpenAI features sent with the value that
turns them off (`NOOP_VALUES`, e.g. `"functions": []`). Range checks belong to
SamplingParams, so this module checks only shapes and types (and that
integers fit 64 bits, the one range every consumer shares).

Extensions (vLLM's sampling fields, tokenriver's `trace`, `metrics`,
`token_ids`, beam search's `beam_width` / `length_penalty` / `early_stopping`
/ `beam_trace` and `beam_score` / `beam_steps`) are left out of a response
when they are None, so a plain OpenAI client sees OpenAI's shape.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from tokenriver.errors import InvalidParameterError

# Fields OpenAI clients commonly send that have no effect here: accepted and ignored.
IGNORED_FIELDS: tuple[str, ...] = ("user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier")

# Unsupported OpenAI features, accepted only with a value that turns them off.
NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
}

# Message fields that OpenAI returns and clients echo back in the history: accepted when empty.
MESSAGE_NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "refusal": (None,),
    "annotations": (None, []),
    "audio": (None,),
    "function_call": (None,),
}


def json_object(body: bytes) -> dict[str, Any]:
    """Bytes of a request body → its JSON object, with text that is valid Unicode throughout; every API's routes
    decode their bodies here, so a malformed body gets the same 400 whichever API it was sent to."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise InvalidParameterError(
            "the request body nests JSON too deeply; send a flatter object", param=None
        ) from None
    except ValueError as error:  # not JSON, not UTF-8, or an integer of more digits than Python converts
        raise InvalidParameterError(
            f"the request body is not valid JSON ({error}); send a JSON object", param=None
        ) from None
    if not isinstance(data, dict):
        raise InvalidParameterError(f"the request body must be a JSON object, not {type(data).__name__}", param=None)
    _refuse_lone_surrogates(data)
    return data


def parse_request(model: type[BaseModel], body: bytes) -> Any:
    """Bytes of a JSON body → a validated request model (pydantic.ValidationError or InvalidParameterError)."""
    data = _drop_noop_fields(json_object(body), NOOP_VALUES, IGNORED_FIELDS, "")
    if isinstance(data.get("messages"), list):
        data["messages"] = [
            _drop_noop_fields(m, MESSAGE_NOOP_VALUES, (), f"messages[{i}].") if isinstance(m, dict) else m
            for i, m in enumerate(data["messages"])
        ]
    return model.model_validate(data)


def _refuse_lone_surrogates(data: dict[str, Any]) -> None:
    """JSON may escape half of a UTF-16 surrogate pair ("\\ud800"), which decodes to a str no UTF-8 codec (the
    tokenizer's, the response's) accepts: refuse it here, naming the field, instead of failing deep inside."""
    pending: list[tuple[str, Any]] = [("", data)]
    while pending:  # iterative: a deeply nested body must not exhaust the stack
        path, value = pending.pop()
        if isinstance(value, dict):
            pending.extend((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
            keys = [key for key in value if _has_lone_surrogate(key)]
            if keys:
                raise InvalidParameterError(
                    f"{path or 'the request'} has a key with a lone UTF-16 surrogate; send valid Unicode text",
                    param=path or None,
                )
        elif isinstance(value, list):
            pending.extend((f"{path}[{index}]", item) for index, item in enumerate(value))
        elif isinstance(value, str) and _has_lone_surrogate(value):
            raise InvalidParameterError(
                f"{path} holds a lone UTF-16 surrogate (such as \\ud800), which is not text; send valid Unicode",
                param=path,
            )


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _drop_noop_fields(
    data: dict[str, Any], noop_values: dict[str, tuple[Any, ...]], ignored: tuple[str, ...], prefix: str
) -> dict[str, Any]:
    kept = {}
    for key, value in data.items():
        if key in ignored:
            continue
        if key in noop_values:
            if value not in noop_values[key]:
                allowed = " or ".join(json.dumps(v) for v in noop_values[key])
                raise InvalidParameterError(
                    f"{prefix}{key} is not supported by tokenriver; remove it (accepted only as {allowed})",
                    param=prefix + key,
                )
            continue
        kept[key] = value
    return kept


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


# Every integer a request carries must fit 64 bits: larger ones could not reach a tensor (or a seed) intact.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class Request(BaseModel):
    """Strict and closed (see the module docstring); null always means "not given", so defaults live in serving."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Request):
    # Send one more chunk before [DONE] with the request's usage (and no choices).
    include_usage: bool | None = None


class JsonSchemaFormat(Request):
    """response_format.json_schema: OpenAI's structured outputs (the openai SDK's `parse` sends this)."""

    name: str
    description: str | None = None
    # The JSON schema the output must validate against; "schema" clashes with a BaseModel attribute.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    # The schema is always enforced by grammar; strict only says the client relies on it.
    strict: bool | None = None


class ResponseFormat(Request):
    """OpenAI's response_format: free text, any JSON object, or JSON that validates against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(Request):
    """vLLM's structured_outputs: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(Request):
    """The sampling fields completions and chat share (OpenAI's, then vLLM's, then tokenriver's)."""

    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    max_tokens: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Token id (as a string, JSON keys are strings) → bias added to its logit.
    logit_bias: dict[str, float] | None = None
    # vLLM extensions.
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # Lower runs first when the engine must choose (vLLM's meaning).
    priority: Int64 | None = None
    # tokenriver extensions: a StepTrace per generated token, keeping trace_top candidates; trace_stages adds each
    # sampling stage's distribution over them, as computed at that step.
    trace: bool | None = None
    trace_top: Int64 | None = None
    trace_stages: bool | None = None
    # tokenriver extensions: beam search with beam_width beams (transformers' num_beams); the n best finished
    # beams come back as the choices, ranked by sum of logprobs / (length ** length_penalty). early_stopping:
    # true, false or "never", with transformers' meanings. No streaming deltas: one chunk when it ends.
    beam_width: Int64 | None = None
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    # tokenriver extension: with beam_width, the response's beam_steps records every step of the search (its
    # beams, their ranked continuations, which ran on, finished or were pruned). Not with stream.
    beam_trace: bool | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # tokenriver extension: token ids the constraint has already covered, when this request continues an earlier
    # constrained output (usually the prompt's tail); the grammar consumes them before the first generated token.
    structured_output_prefix_ids: list[Int64] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: object) -> object:
        if (
            value is None
            or isinstance(value, str)
            or (isinstance(value, list) and all(isinstance(s, str) for s in value))
        ):
            return value
        raise PydanticCustomError("stop_type", "must be a string or a list of strings")


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    # A string, a list of token ids, or a batch: a list of strings or a list of token-id lists.
    prompt: str | list[int] | list[str] | list[list[int]]
    # Prepend the prompt to the returned text (and its logprobs when logprobs is set).
    echo: bool | None = None
    # Top alternatives per token, in the legacy completions format; 0 = only the chosen token's.
    logprobs: Int64 | None = None
    best_of: Int64 | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: object) -> object:
        if isinstance(value, str) or _is_token_ids(value):
            return value
        if (
            isinstance(value, list)
            and value
            and (all(isinstance(p, str) for p in value) or all(_is_token_ids(p) for p in value))
        ):
            return value
        raise PydanticCustomError(
            "prompt_type", "must be a string, a list of token ids, or a non-empty list of strings or of token-id lists"
        )


class TextPart(Request):
    type: Literal["text"]
    text: str


class FunctionCallIn(Request):
    name: str
    # The arguments as a JSON text, as OpenAI sends them.
    arguments: str


class ToolCallIn(Request):
    """A tool call of an earlier assistant message, echoed back in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # Assistant messages: the tools it called. Tool messages: which call this is the result of.
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # Assistant messages: the thinking a reasoning model returned (not sent back to the model).
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: object) -> object:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            for part in value:
                if isinstance(part, dict) and part.get("type") not in (None, "text"):
                    raise PydanticCustomError(
                        "content_part",
                        "content part type {kind!r} is not supported: send text parts only",
                        {"kind": part.get("type")},
                    )
            if all(isinstance(p, dict) and set(p) == {"type", "text"} and isinstance(p["text"], str) for p in value):
                return value
        raise PydanticCustomError(
            "content_type", 'must be a string or a list of text parts ({"type": "text", "text": "..."})'
        )

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(Request):
    name: str
    description: str | None = None
    # JSON schema of the arguments (None = no arguments).
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Request):
    name: str


class NamedToolChoice(Request):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    # Tools the model may call, and whether it must ("required", or a named one), may ("auto") or may not ("none").
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    messages: list[ChatMessage] = Field(min_length=1)
    # OpenAI's newer name for max_tokens.
    max_completion_tokens: Int64 | None = None
    # Return the chosen token's logprob; top_logprobs adds that many alternatives.
    logprobs: bool | None = None
    top_logprobs: Int64 | None = None
    # vLLM extensions: end the prompt with the assistant header; extra variables for the chat template.
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(Request):
    """POST /tokenize: either a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Messages only: end with the assistant header (default true).
    add_generation_prompt: bool | None = None
    # Prompt only: add BOS/EOS as the model asks (default true; the chat template writes its own).
    add_special_tokens: bool | None = None


class DetokenizeRequest(Request):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[Int64]


# ----- responses ------------------------------------------------------------------------------------


class Response(BaseModel):
    """Response models: extension fields use `_omit_none` so OpenAI clients see OpenAI's shape."""


def _omit_none(default: Any = None) -> Any:
    return Field(default=default, exclude_if=lambda value: value is None)


class PromptTokensDetails(Response):
    cached_tokens: int = 0


class Usage(Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class RequestMetricsInfo(Response):
    """tokenriver extension: how the engine served a request (docs/serving.md)."""

    time_to_first_token: float | None
    time_per_output_token: float | None
    queue_time: float | None
    num_cached_tokens: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_forward_passes: int
    kv_blocks: int
    # Speculative decoding (when the server runs with a draft): draft tokens verified, accepted, and the rate.
    num_draft_tokens: int | None = _omit_none()
    num_accepted_draft_tokens: int | None = _omit_none()
    draft_acceptance_rate: float | None = _omit_none()


class CompletionLogprobs(Response):
    """The legacy completions format: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM extension: the stop string or stop token id that matched.
    stop_reason: str | int | None = _omit_none()
    # tokenriver extensions (token_ids: with trace or beam_trace).
    token_ids: list[int] | None = _omit_none()
    trace: list[dict[str, Any]] | None = _omit_none()
    # Beam search: the beam's length-normalized score (transformers' sequences_scores).
    beam_score: float | None = _omit_none()


class CompletionResponse(Response):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = _omit_none()
    metrics: RequestMetricsInfo | None = _omit_none()
    # beam_trace: one list of beam-search steps per prompt (trace.BeamStep.to_dict), in the prompts' order.
    beam_steps: list[list[dict[str, Any]]] | None = _omit_none()


class TopLogprob(Response):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Response):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Response):
    content: list[TokenLogprob]
    refusal: None = None


class FunctionCallOut(Response):
    name: str
    arguments: str


class ToolCallOut(Response):
    id: str
    type: str = "function"
    function: FunctionCallOut


class ChatMessageOut(Response):
    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = _omit_none()
    # A reasoning model's thinking, under vLLM's older and newer names.
    reasoning_content: str | None = _omit_none()
    reasoning: str | None = _omit_none()


class ChatChoice(Response):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: str | int | None = _omit_none()
    trace: list[dict[str, Any]] | None = _omit_none()
    # Beam search: the beam's length-normalized score (transformers' sequences_scores).
    beam_score: float | None = _omit_none()


class ChatCompletionResponse(Response):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    metrics: RequestMetricsInfo | None = _omit_none()
    # beam_trace: the beam search's steps (trace.BeamStep.to_dict).
    beam_steps: list[dict[str, Any]] | None = _omit_none()


class FunctionCallDelta(Response):
    name: str | None = _omit_none()
    arguments: str | None = _omit_none()


class ToolCallDelta(Response):
    """A piece of a streamed tool call: the first piece of a call carries its id and name."""

    index: int
    id: str | None = _omit_none()
    type: str | None = _omit_none()
    function: FunctionCallDelta


class DeltaMessage(Response):
    role: str | None = _omit_none()
    content: str | None = _omit_none()
    tool_calls: list[ToolCallDelta] | None = _omit_none()
    reasoning_content: str | None = _omit_none()
    reasoning: str | None = _omit_none()


class ChatChunkChoice(Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = _omit_none()
    token_ids: list[int] | None = _omit_none()
    trace: list[dict[str, Any]] | None = _omit_none()


class ChatCompletionChunk(Response):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = _omit_none()
    metrics: RequestMetricsInfo | None = _omit_none()


class ErrorInfo(Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Response):
    error: ErrorInfo
