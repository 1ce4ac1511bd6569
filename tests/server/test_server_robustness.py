"""Hostile and extreme requests: each gets 200, 400 naming the field, or 429 with Retry-After, never a 500; the
engine stays alive for the next, and the KV pool is empty again after each.

Extreme but valid sampling values; lone UTF-16 surrogates; NaN and Infinity where numbers go; deeply nested JSON;
integers of any size; and a full waiting queue (two requests run, one waits, the next is refused).
On its own server, because a value that kills the engine would fail every later test of a shared one.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from server_harness import start_server, stop_server

MAX_NUM_SEQS = 2
MAX_WAITING_REQUESTS = 1

EXTREME_VALUES = [
    {"temperature": 1e-30},
    {"temperature": 1e300},
    {"repetition_penalty": 1e300},
    {"min_p": 1e-300},
    {"top_k": 2**63 - 1},
    {"seed": 2**63 - 1, "n": 2, "temperature": 1.0},
    {"seed": -(2**63)},
    {"logit_bias": {"5": 100, "6": -100}},
    {"frequency_penalty": 2, "presence_penalty": -2, "repetition_penalty": 2.0},
    # Values that underflow to 0 in float32: greedy / keep the top token / a clear 400.
    {"top_p": 1e-300},
    {"temperature": 1e-300},
    {"repetition_penalty": 1e-300},
]


@pytest.fixture(scope="module")
def own_server():
    started = start_server(["--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING_REQUESTS)])
    yield started
    stop_server(started)


def _wait_until_idle(server, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            server.metric("tokenriver_num_requests_running") == 0
            and server.metric("tokenriver_num_requests_waiting") == 0
            and server.metric("tokenriver_kv_cache_blocks_used") == 0
        ):
            return
        time.sleep(0.1)
    raise AssertionError("the engine did not go idle")


@pytest.fixture(autouse=True)
def pool_empty_after(own_server):
    """After every test: nothing running or waiting, every KV block free, the engine healthy."""
    yield
    _wait_until_idle(own_server)
    assert own_server.metric("tokenriver_kv_cache_blocks_free") == own_server.metric("tokenriver_kv_cache_blocks_total")
    assert httpx.get(own_server.url + "/health", timeout=10).status_code == 200


def _post_raw(server, path: str, body: bytes) -> httpx.Response:
    return httpx.post(
        server.url + path, content=body, timeout=60, headers={**server.headers(), "Content-Type": "application/json"}
    )


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("values", EXTREME_VALUES)
def test_extreme_values_never_kill_the_engine(own_server, values):
    response = httpx.post(
        own_server.url + "/v1/completions",
        headers=own_server.headers(),
        timeout=60,
        json={"prompt": "Hi there", "max_tokens": 3, **values},
    )
    assert response.status_code in (200, 400), response.text
    assert httpx.get(own_server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfff"}]}]}',
            "messages[0].content[0].text",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": "x\\udc00y"}]}',
            "messages[1].content",
        ),
        ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", '{"prompt": ["fine", "\\ud83d"]}', "prompt[1]"),
        ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"]}', "stop[0]"),
        ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(own_server, path, body, param):
    error = _error(_post_raw(own_server, path, body.encode()))
    assert error["param"] == param and "surrogate" in error["message"]


def test_a_surrogate_pair_is_text(own_server):
    body = '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}'
    assert _post_raw(own_server, "/v1/chat/completions", body.encode()).status_code == 200


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty", "max_tokens", "seed", "n"]
)
def test_nan_and_infinity_are_400(own_server, field, constant):
    body = f'{{"prompt": "Hi there", "max_tokens": 2, "{field}": {constant}}}'.replace(
        '"max_tokens": 2, "max_tokens"', '"max_tokens"'
    )
    error = _error(_post_raw(own_server, "/v1/completions", body.encode()))
    assert error["param"] == field, error


def test_nan_in_logit_bias_is_400(own_server):
    error = _error(_post_raw(own_server, "/v1/completions", b'{"prompt": "Hi", "logit_bias": {"5": NaN}}'))
    assert error["param"].startswith("logit_bias")


@pytest.mark.parametrize("depth", [50, 900, 5000, 20000])
def test_deeply_nested_json_is_400(own_server, depth):
    for field in ("prompt", "logit_bias", "messages"):
        body = f'{{"{field}": ' + "[" * depth + "]" * depth + "}"
        error = _error(
            _post_raw(own_server, "/v1/completions" if field != "messages" else "/v1/chat/completions", body.encode())
        )
        assert error["param"] in (None, field) or error["param"].startswith(field), error


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("max_tokens", 10**30, "max_tokens"),
        ("seed", 2**64, "seed"),
        ("seed", -(2**63) - 1, "seed"),
        ("n", 10**20, "n"),
        ("top_k", -(10**40), "top_k"),
        ("logprobs", 2**63, "logprobs"),
        ("prompt", [2**70], "prompt"),
        ("logit_bias", {str(10**30): 1}, None),
        ("seed", int("9" * 4000), "seed"),
    ],
)
def test_huge_integers_are_400(own_server, field, value, param):
    body = {"prompt": "Hi there", "max_tokens": 2, field: value}
    error = _error(_post_raw(own_server, "/v1/completions", json.dumps(body).encode()))
    if param is not None:
        assert error["param"] == param, error


def test_more_digits_than_python_converts_is_400(own_server):
    error = _error(_post_raw(own_server, "/v1/completions", b'{"prompt": "Hi", "seed": ' + b"9" * 5000 + b"}"))
    assert "JSON" in error["message"]


async def _fill_the_queue_then_overflow(server) -> tuple[httpx.Response, float, float]:
    """MAX_NUM_SEQS long streams run, one more waits; the next is refused. Returns (refused response, the
    rejection counter before, after)."""
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    rejected_before = server.metric("tokenriver_requests_rejected_total")
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=120) as client:
        streams = [client.stream("POST", "/v1/completions", json=body) for _ in range(MAX_NUM_SEQS)]
        responses = [await stream.__aenter__() for stream in streams]
        try:
            for response in responses:
                assert response.status_code == 200
            waiting = asyncio.create_task(client.post("/v1/completions", json={**body, "stream": False}))
            deadline = time.monotonic() + 60
            while server.metric("tokenriver_num_requests_waiting") < MAX_WAITING_REQUESTS:
                assert time.monotonic() < deadline, "the third request never waited"
                await asyncio.sleep(0.05)
            refused = await client.post("/v1/completions", json=body)
            refused_chat = await client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
            )
            waiting.cancel()
            assert refused_chat.status_code == 429
        finally:
            for stream in streams:
                await stream.__aexit__(None, None, None)
    return refused, rejected_before, server.metric("tokenriver_requests_rejected_total")


def test_a_full_waiting_queue_is_429_with_retry_after(own_server):
    refused, before, after = asyncio.run(_fill_the_queue_then_overflow(own_server))
    error = _error(refused, 429)
    assert error["code"] == "server_overloaded" and "max_waiting_requests" in error["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert after - before == 2
    _wait_until_idle(own_server)
    # Room again: the next request runs.
    response = httpx.post(
        own_server.url + "/v1/completions",
        headers=own_server.headers(),
        timeout=60,
        json={"prompt": "Hi there", "max_tokens": 2},
    )
    assert response.status_code == 200
