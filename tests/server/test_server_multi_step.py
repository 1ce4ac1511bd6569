"""`tokenriver serve --num-scheduler-steps N`: streamed text arrives in bursts of up to N tokens and equals what the
single-step shared server generates."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from server_harness import ServerProcess, start_server, stop_server

PROMPT = "The three primary colors are"
NUM_TOKENS = 13


@pytest.fixture(scope="module")
def multi_step_server() -> Iterator[ServerProcess]:
    # The shared single-step server's defaults (tests/server/conftest.py): only the scheduling differs.
    started = start_server(["--num-scheduler-steps", "4"])
    yield started
    stop_server(started)


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


def test_multi_step_stream_equals_the_single_step_text(server, multi_step_server):
    kwargs = dict(prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    with _client(server) as single, _client(multi_step_server) as multi:
        (model,) = single.models.list().data
        expected = single.completions.create(model=model.id, **kwargs).choices[0].text
        pieces, usage = [], None
        for chunk in multi.completions.create(
            model=model.id, stream=True, stream_options={"include_usage": True}, **kwargs
        ):
            usage = chunk.usage or usage
            pieces += [choice.text for choice in chunk.choices if choice.text]
    assert "".join(pieces) == expected
    assert usage.completion_tokens == NUM_TOKENS
    # The prompt's step gives one token, then steps of four passes: four pieces of text, not thirteen.
    assert len(pieces) <= 5
