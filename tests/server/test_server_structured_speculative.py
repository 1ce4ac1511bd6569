"""Structured output with speculative decoding (n-gram drafts): drafts the grammar rejects are cut, and the
output is what the server without speculation gives (greedy), or validates (sampled)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from server_harness import ServerProcess, start_server, stop_server

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "count": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["name", "count"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def speculative_server() -> Iterator[ServerProcess]:
    # The shared server's defaults (tests/server/conftest.py), so that its greedy output is the one to equal.
    started = start_server(["--speculative-draft", "ngram"])
    yield started
    stop_server(started)


def _chat(server: ServerProcess, **fields) -> dict:
    body = {
        "messages": [{"role": "user", "content": "List three fruits with counts as JSON."}],
        "max_tokens": 96,
        "response_format": {"type": "json_schema", "json_schema": {"name": "list", "schema": SCHEMA}},
        **fields,
    }
    response = httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers(), timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_schema_with_ngram_speculation(server, speculative_server):
    speculative = _chat(speculative_server, temperature=0)
    plain = _chat(server, temperature=0)
    text = speculative["choices"][0]["message"]["content"]
    assert text == plain["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), SCHEMA)
    metrics = speculative["metrics"]
    assert metrics["num_draft_tokens"] > 0  # drafts were proposed and verified under the grammar
    # Passes, not tokens: each accepted draft token saved one (a draft accepted past the stop saved none).
    generated, accepted = metrics["num_generated_tokens"], metrics["num_accepted_draft_tokens"]
    assert generated - accepted <= metrics["num_forward_passes"] < plain["metrics"]["num_forward_passes"]
    assert plain["metrics"]["num_forward_passes"] == plain["metrics"]["num_generated_tokens"]
    sampled = _chat(speculative_server, temperature=1.0, seed=3, n=2)
    for choice in sampled["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
