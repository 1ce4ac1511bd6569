"""The command line's tool flags: --tools (a file or inline JSON) and --tool-choice become what LLM.chat takes,
bad values are one-line errors before the model loads, and `tokenriver chat` prints a forced call as a JSON line
(in OpenAI's shape) that matches LLM.chat's call for the same conversation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tokenriver.cli import build_parser, main, tools_from
from tokenriver.engine.llm import LLM
from tokenriver.params import SamplingParams

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
            },
        },
    }
]


def _tools(*flags: str):
    return tools_from(build_parser().parse_args(["chat", *flags]))


def test_tool_flags(tmp_path):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS))
    assert _tools("--tools", str(path)) == (TOOLS, None)
    assert _tools("--tools", json.dumps(TOOLS), "--tool-choice", "required") == (TOOLS, "required")
    assert _tools("--tools", json.dumps(TOOLS), "--tool-choice", "get_weather") == (
        TOOLS,
        {"type": "function", "function": {"name": "get_weather"}},
    )
    assert _tools() == (None, None)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tools", "[{not json"], "--tools is neither a file nor valid JSON"),
        (["--tools", json.dumps(TOOLS), "--tool-choice", "nope"], "not among the tools"),
        (["--tool-choice", "required"], "tool_choice needs tools"),
        (["--tools", '{"name": "f"}'], "tools must be a list"),
    ],
)
def test_bad_tool_flags_are_one_line_errors(flags, message, capsys):
    assert main(["chat", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_chat_prints_a_forced_call_as_a_json_line(loaded_packed):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenriver.cli",
            "chat",
            "--tools",
            json.dumps(TOOLS),
            "--tool-choice",
            "required",
            "--max-tokens",
            "40",
            "--threads",
            "2",
            "--no-int8-activations",
        ],
        input="What is the weather in Paris?\n",
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr
    (printed,) = [json.loads(line[line.index("{") :]) for line in result.stdout.splitlines() if "{" in line]
    (expected,) = (
        LLM.from_loaded(loaded_packed)
        .chat(
            [{"role": "user", "content": "What is the weather in Paris?"}],
            SamplingParams(max_tokens=40, temperature=0),
            use_tqdm=False,
            tools=TOOLS,
            tool_choice="required",
        )[0]
        .outputs[0]
        .tool_calls
    )
    assert printed["type"] == "function" and printed["id"].startswith("call_")
    assert printed["function"] == {"name": expected.name, "arguments": expected.arguments}
