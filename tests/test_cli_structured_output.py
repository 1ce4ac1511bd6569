"""The command line's structured-output flags become the SamplingParams constraint they name."""

from __future__ import annotations

import json

import pytest

from tokenriver.cli import build_parser, sampling_params_from
from tokenriver.params import StructuredOutput


def _constraint(*flags: str) -> StructuredOutput | None:
    return sampling_params_from(build_parser().parse_args(["generate", "hi", *flags])).structured_output


def test_structured_output_flags(tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    assert json.loads(_constraint("--json-schema", str(path)).text) == schema
    assert json.loads(_constraint("--json-schema", json.dumps(schema)).text) == schema
    assert _constraint("--json-object") == StructuredOutput.json_object()
    assert _constraint("--regex", "[0-9]+") == StructuredOutput.regex("[0-9]+")
    assert _constraint("--choice", "yes", "--choice", "no") == StructuredOutput.choice(["yes", "no"])
    assert _constraint("--grammar", 'start: "a"') == StructuredOutput.grammar('start: "a"')
    assert _constraint() is None
    with pytest.raises(SystemExit):  # one constraint at most
        _constraint("--regex", "a", "--json-object")
