"""Chat template rendering: messages -> one prompt string, the way transformers renders it.

A chat template is a jinja2 program shipped with the model (GGUF `tokenizer.chat_template`,
`tokenizer_config.json` or `chat_template.jinja`). transformers' `apply_chat_template` is the de facto
definition of what it means, so this module reproduces its environment: an immutable sandbox (templates
are untrusted code), `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}`
block, the globals `raise_exception` and `strftime_now`, a `tojson` filter that does not HTML-escape, and the
variables `messages`, `add_generation_prompt`, `tools`, `documents` and the special token strings.

Owns: compiling (cached per template text) and rendering. Knows nothing about token ids.
Every jinja failure becomes an `InvalidParameterError` carrying jinja's own message.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenriver.errors import InvalidParameterError

# Names a message's reasoning may be passed under; transformers copies it to all of them.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged.

    transformers uses the block to find assistant tokens for training masks; for inference only the text
    matters, but a template that uses the tag must still compile.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    """Lets a template reject a conversation (wrong role order, unsupported role...)."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Plain `json.dumps`: jinja's built-in filter HTML-escapes `<`, `>`, `&`, which would corrupt prompts."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile once per distinct template text (a server renders the same one for every request)."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(template)
    except jinja2.TemplateError as error:
        raise InvalidParameterError(
            f"the model's chat template does not compile: {error.message}. "
            "Pass a plain prompt instead, or fix the template.",
            param="chat_template",
        ) from error


def _plain(value: Any) -> Any:
    """A copy made only of JSON types, so the template never sees (or mutates) the caller's objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (str enums, numpy scalars...) are cut back to the base type and its harmless methods.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return f"<{type(value).__name__}>"


def _prepare_message(message: dict[str, Any]) -> dict[str, Any]:
    """transformers drops keys whose value is None (OpenAI's `content: null`) and aliases reasoning fields."""
    prepared = {key: _plain(value) for key, value in message.items() if value is not None}
    reasoning = next((prepared[key] for key in _REASONING_FIELDS if key in prepared), None)
    if reasoning is not None:
        prepared = {"thinking": reasoning, **prepared, "reasoning_content": reasoning}
    return prepared


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` (already validated) into the prompt text.

    `special_tokens` maps `bos_token`, `eos_token`, `unk_token`, `pad_token` to their strings; `kwargs`
    (such as `enable_thinking`) are passed to the template and override them, as in transformers.
    """
    compiled = compile_chat_template(template)
    variables = {**special_tokens, **{key: _plain(value) for key, value in kwargs.items()}}
    try:
        return compiled.render(
            messages=[_prepare_message(message) for message in messages],
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as error:
        raise InvalidParameterError(
            f"the model's chat template rejected these messages: {error.message}",
            param="messages",
        ) from error
