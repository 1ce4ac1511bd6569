"""The request fields that constrain the output, mapped onto one StructuredOutput.

Three spellings reach the same engine feature: OpenAI's `response_format` (`json_schema`, `json_object`,
`text`), vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`) and vLLM's older `guided_*`
fields. At most one constraint may be given; two would have to be intersected, which no backend does, so
the request is refused naming both fields rather than one being dropped.
"""

from __future__ import annotations

import json
from typing import Any

from tokenriver.errors import InvalidParameterError
from tokenriver.params import StructuredOutput
from tokenriver.server.protocol import SamplingFields


def structured_output(request: SamplingFields) -> tuple[str, StructuredOutput] | None:
    """(the field that gave it, the request's constraint), or None for free text; InvalidParameterError names
    the offending field."""
    found: list[tuple[str, StructuredOutput]] = []

    def add(field: str, make: Any, value: Any) -> None:
        try:
            found.append((field, make(value)))
        except InvalidParameterError as error:
            raise InvalidParameterError(f"{field}: {error.message}", param=field) from None

    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        add("response_format", lambda _: StructuredOutput.json_object(), None)
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None or response_format.json_schema.schema_ is None:
            raise InvalidParameterError(
                'response_format of type "json_schema" needs json_schema.schema', param="response_format.json_schema"
            )
        add("response_format.json_schema", StructuredOutput.json, response_format.json_schema.schema_)
    outputs = request.structured_outputs
    if outputs is not None:
        for name, make in (
            ("json_", StructuredOutput.json),
            ("regex", StructuredOutput.regex),
            ("choice", StructuredOutput.choice),
            ("grammar", StructuredOutput.grammar),
        ):
            value = getattr(outputs, name)
            if value is not None:
                add(f"structured_outputs.{name.rstrip('_')}", make, value)
        if outputs.json_object:
            add("structured_outputs.json_object", lambda _: StructuredOutput.json_object(), None)
    for field, make in (
        ("guided_json", StructuredOutput.json),
        ("guided_regex", StructuredOutput.regex),
        ("guided_choice", StructuredOutput.choice),
        ("guided_grammar", StructuredOutput.grammar),
    ):
        value = getattr(request, field)
        if value is not None:
            add(field, make, _parsed_json(field, value) if field == "guided_json" else value)
    if len(found) > 1:
        names = " and ".join(field for field, _ in found)
        raise InvalidParameterError(f"{names} both constrain the output; send only one", param=found[1][0])
    return found[0] if found else None


def _parsed_json(field: str, value: dict[str, Any] | str) -> dict[str, Any] | str:
    """guided_json may come as a JSON text; it must hold a JSON object."""
    if isinstance(value, dict):
        return value
    try:
        return json.loads(value)
    except ValueError as error:
        raise InvalidParameterError(f"{field} is not valid JSON ({error})", param=field) from None
