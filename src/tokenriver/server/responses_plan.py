"""One Responses request checked, translated and planned as a chat request: the `ResponsesPlan`.

The conversation is the previous response's (from the store) followed by the request's input items; the
instructions become a leading system message, outside the conversation a stored response keeps. The chat request
is planned by OpenAIServing's chat path, so the template, tool grammars, structured output (text.format) and
sampler are those of /v1/chat/completions.

- max_output_tokens is an upper bound: planned without it, then capped at what the context has room for; output
  cut there makes the response incomplete (reason max_output_tokens), never a 400.
- a tool grammar and a JSON text.format cannot both hold: a 400 naming text.format. A tool grammar is active
  when tools are offered (tool_choice not "none"), or when a forced custom tool has a grammar; a forced custom
  tool without one offers no tools, so its input may follow text.format.
- a custom tool's regex, offered as a function, is the pattern of its `input`: it is compiled here, so that a bad
  one names `tools[i].format.definition` rather than the whole tool grammar.
- errors name the field the client sent (`input[2]`, `instructions`, `max_output_tokens`, `text.format`,
  `tools[1].tools[0]`), not the chat field they were found in (`_renamed`): a chat message is traced back to the
  field it came from (`ChatMessages.sources`), and an error message's leading field name is rewritten with its
  param, the rest of its text left as it is.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tokenriver.errors import ContextLengthError, InvalidParameterError
from tokenriver.params import StructuredOutput
from tokenriver.server.protocol import ChatCompletionRequest
from tokenriver.server.responses_input import ChatMessages, chat_messages, parse_input_items
from tokenriver.server.responses_protocol import REFUSED_INCLUDES, InputItem, ResponsesRequest
from tokenriver.server.responses_store import ResponseStore, StoredResponseNotFoundError
from tokenriver.server.responses_tools import ToolSet, ToolTarget, build_tools, chat_tool_choice, with_tool_prompt
from tokenriver.server.serving import GenerationPlan, OpenAIServing
from tokenriver.server.tools import request_tools

# The field name an error message starts with: `messages[3].content`, `tools[1].function.parameters`.
_LEADING_FIELD = re.compile(r"[a-z_][a-z0-9_]*(?:\[\d+\]|\.[a-z_][a-z0-9_]*)*")


def new_id(prefix: str) -> str:
    """A fresh id for a response or an output item: `<prefix>_<32 hex digits>`."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponsesPlan:
    """A Responses request, planned as a chat request, with what it takes to read the output back."""

    response_id: str
    created_at: int
    request: ResponsesRequest
    chat: GenerationPlan
    tools: ToolSet
    # The custom tool whose input the whole output is (tool_choice forced it), or None.
    forced_custom: ToolTarget | None
    conversation: list[InputItem]


def plan_response(serving: OpenAIServing, request: ResponsesRequest, store: ResponseStore) -> ResponsesPlan:
    """Check, translate and plan one request (errors name the Responses fields)."""
    _check_request(request, store)
    earlier = _earlier_conversation(request.previous_response_id, store)
    conversation = [*earlier, *parse_input_items(request.input)]
    if not conversation:
        raise InvalidParameterError("input is empty: send a string or at least one input item", param="input")
    tools = build_tools(request.tools)
    choice, forced = chat_tool_choice(request.tool_choice, tools)
    _check_one_constraint(request, tools, choice, forced)
    _check_tool_patterns(serving, tools, choice, forced)
    messages = prompt_messages(request, conversation, len(earlier), forced)
    try:
        chat_request = _chat_request(request, messages.messages, tools, choice, forced)
        chat = _plan_chat(serving, chat_request, request.max_output_tokens)
    except InvalidParameterError as error:
        raise _renamed(error, tools, forced, messages.sources) from None
    response_id = new_id("resp")
    chat = dataclasses.replace(chat, response_id=response_id)
    return ResponsesPlan(response_id, chat.created, request, chat, tools, forced, conversation)


def _check_request(request: ResponsesRequest, store: ResponseStore) -> None:
    if request.background:
        raise InvalidParameterError(
            "background responses are not supported: send background: false and keep the request open",
            param="background",
        )
    refused = [value for value in request.include or [] if value in REFUSED_INCLUDES]
    if refused:
        raise InvalidParameterError(f"include {refused[0]!r} is not supported; remove it", param="include")
    if request.store and store.max_size == 0:
        raise InvalidParameterError(
            "this server keeps no responses (--responses-store-size 0): send store: false, or start the server "
            "with a larger --responses-store-size",
            param="store",
        )
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type == "json_schema" and text_format.schema_ is None:
        raise InvalidParameterError('a text.format of type "json_schema" needs a schema', param="text.format.schema")


def _earlier_conversation(previous_response_id: str | None, store: ResponseStore) -> list[InputItem]:
    if previous_response_id is None:
        return []
    stored = store.get(previous_response_id)
    if stored is None:
        raise StoredResponseNotFoundError(
            store.not_found_message(previous_response_id), "previous_response_id", "previous_response_not_found"
        )
    return stored.continued()


def _check_one_constraint(request: ResponsesRequest, tools: ToolSet, choice: Any, forced: ToolTarget | None) -> None:
    """A tool grammar and a JSON text.format cannot both hold: say so naming text.format."""
    text_format = request.text.format if request.text is not None else None
    if text_format is None or text_format.type == "text":
        return
    if forced is not None:
        # A forced custom tool is not offered as a tool: only its own grammar, if any, constrains the output.
        if forced.format is not None and forced.format.type == "grammar":
            raise InvalidParameterError(
                f"text.format {text_format.type!r} cannot hold together with the grammar of the forced custom tool "
                f"{forced.name!r} ({forced.path}.format), which the whole output follows; send one of them",
                param="text.format",
            )
    elif tools.chat_tools and choice != "none":
        raise InvalidParameterError(
            f"text.format {text_format.type!r} cannot hold together with tools, whose calls a grammar enforces; "
            f'send one of them (or tool_choice: "none")',
            param="text.format",
        )


def _check_tool_patterns(serving: OpenAIServing, tools: ToolSet, choice: Any, forced: ToolTarget | None) -> None:
    """Compile the regex of each custom tool the model may call as a function (the pattern of its `input`), so a
    bad one names the tool's format.definition; the tools' grammar as a whole could only name `tools`."""
    # A forced custom tool is no function, "none" offers none, and a named choice names a function tool.
    if forced is not None or choice == "none" or isinstance(choice, dict):
        return
    for chat_tool, target in zip(tools.chat_tools, tools.targets.values(), strict=True):
        if target.kind != "custom" or target.format is None or target.format.syntax != "regex":
            continue
        try:
            serving.engine.check_structured_output(StructuredOutput.json(chat_tool["function"]["parameters"]))
        except InvalidParameterError as error:
            param = f"{target.path}.format.definition"
            raise InvalidParameterError(f"{param}: {error.message}", param=param) from None


def prompt_messages(
    request: ResponsesRequest, conversation: list[InputItem], num_earlier: int, forced: ToolTarget | None
) -> ChatMessages:
    """The chat messages of the prompt: the instructions, the conversation (its first `num_earlier` items from
    previous_response_id) and a forced custom tool's prompt, each message with the field it came from."""
    if isinstance(request.input, str):
        input_sources = ["input"]
    else:
        input_sources = [f"input[{index}]" for index in range(len(conversation) - num_earlier)]
    messages = chat_messages(conversation, ["previous_response_id"] * num_earlier + input_sources)
    if request.instructions:
        messages = messages.with_first({"role": "system", "content": request.instructions}, "instructions")
    return messages if forced is None else with_tool_prompt(messages, forced)


def _chat_request(
    request: ResponsesRequest,
    messages: list[dict[str, Any]],
    tools: ToolSet,
    choice: Any,
    forced: ToolTarget | None,
) -> ChatCompletionRequest:
    body: dict[str, Any] = {
        "messages": messages,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "stream": request.stream,
        "stream_options": {"include_usage": True} if request.stream else None,
        "response_format": _response_format(request),
        "structured_outputs": _custom_constraint(forced),
    }
    if forced is None:
        body.update(tools=tools.chat_tools or None, tool_choice=choice, parallel_tool_calls=request.parallel_tool_calls)
    return ChatCompletionRequest.model_validate({key: value for key, value in body.items() if value is not None})


def _response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    text_format = request.text.format if request.text is not None else None
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": text_format.name or "response", "schema": text_format.schema_, "strict": text_format.strict}
    return {"type": "json_schema", "json_schema": {key: value for key, value in schema.items() if value is not None}}


def _custom_constraint(forced: ToolTarget | None) -> dict[str, str] | None:
    """vLLM's structured_outputs for a forced custom tool with a grammar: the whole output follows it."""
    if forced is None or forced.format is None or forced.format.type == "text":
        return None
    return {"grammar" if forced.format.syntax == "lark" else "regex": forced.format.definition or ""}


def _plan_chat(serving: OpenAIServing, request: ChatCompletionRequest, max_output_tokens: int | None) -> GenerationPlan:
    """plan_chat with max_output_tokens read as an upper bound: at most what the context has room for after the
    prompt (None: until the context is full, as chat completions runs)."""
    tool_calling = request_tools(request, serving.tokenizer.chat_template, serving.engine.special_token_id)
    prompt = serving.render_chat(request.messages, None, None, tool_calling)
    room = serving.max_tokens_within_context(prompt, serving.engine.max_model_len, "input")
    max_tokens = None if max_output_tokens is None else min(max_output_tokens, room)
    return serving.plan_rendered_chat(request, prompt, tool_calling, max_tokens, "max_output_tokens", "text.format")


def _renamed(
    error: InvalidParameterError, tools: ToolSet, forced: ToolTarget | None, sources: list[str]
) -> InvalidParameterError:
    """The chat planner's error, naming the Responses field the client sent. An error message starts with its
    param (or a field within it, `messages[3]` for `messages`): only that leading name is rewritten."""
    param = error.param or ""
    new = _responses_param(param, tools, forced, sources)
    message = error.message
    lead = _LEADING_FIELD.match(message)
    if param and lead and (lead.group() == param or lead.group().startswith((f"{param}[", f"{param}."))):
        message = _responses_param(lead.group(), tools, forced, sources) + message[lead.end() :]
    if (new, message) == (param, error.message):
        return error
    if isinstance(error, ContextLengthError):
        return ContextLengthError(message, num_tokens=error.num_tokens, max_tokens=error.max_tokens, param=new)
    return InvalidParameterError(message, param=new)


def _responses_param(param: str, tools: ToolSet, forced: ToolTarget | None, sources: list[str]) -> str:
    """A chat field as the Responses field it came from."""
    message = re.fullmatch(r"messages\[(\d+)\].*", param)
    if message:
        # The message's own fields are chat names: name the item it came from.
        index = int(message.group(1))
        return sources[index] if index < len(sources) else "input"
    if param == "messages" or param.startswith("messages."):
        return "input"
    if param.startswith("structured_outputs") and forced is not None:
        return f"{forced.path}.format.definition"
    if param.startswith("response_format"):
        return "text.format"
    match = re.fullmatch(r"tools\[(\d+)\](?:\.function)?(.*)", param)
    if match and int(match.group(1)) < len(tools.targets):
        target = list(tools.targets.values())[int(match.group(1))]
        if target.kind == "custom" and match.group(2).startswith(".parameters"):
            # A custom tool has no parameters: they were made from its format (a regex is their pattern).
            return f"{target.path}.format.definition"
        return target.path + match.group(2)
    return param
