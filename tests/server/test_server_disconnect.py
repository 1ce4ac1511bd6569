"""Clients that hang up abort their requests: the KV pool ends up fully free."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

NUM_CLIENTS = 20


async def _read_a_little_then_hang_up(client: httpx.AsyncClient, index: int) -> int:
    """Stream a long completion, read three events, close the connection; returns the events seen."""
    body = {"prompt": f"Story number {index}: once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    seen = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen == 3:
                break
    return seen


async def _cut_off_streams(server) -> list[int]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS)
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=120, limits=limits) as client:
        return await asyncio.gather(*(_read_a_little_then_hang_up(client, i) for i in range(NUM_CLIENTS)))


def test_cut_off_streams_free_their_kv_blocks(server):
    total_blocks = server.metric("tokenriver_kv_cache_blocks_total")
    aborted_before = _aborted(server)
    generated_before = server.metric("tokenriver_generation_tokens_total")
    assert asyncio.run(_cut_off_streams(server)) == [3] * NUM_CLIENTS
    _wait_until_idle(server)
    assert server.metric("tokenriver_kv_cache_blocks_used") == 0
    assert server.metric("tokenriver_kv_cache_blocks_free") == total_blocks
    assert server.metric("tokenriver_kv_cache_usage_ratio") == 0
    assert server.metric("tokenriver_num_requests_running") == 0
    assert _aborted(server) - aborted_before == NUM_CLIENTS
    # Each request got 400 tokens of room but was cut after a few: nowhere near 20 * 400 tokens were generated.
    assert server.metric("tokenriver_generation_tokens_total") - generated_before < NUM_CLIENTS * 100


def test_a_non_streaming_client_that_gives_up_aborts_its_request(server):
    aborted_before = _aborted(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/completions",
            headers=server.headers(),
            timeout=0.5,  # the context's 500 tokens take the defaults more than a second
            json={"prompt": "A very long story:", "max_tokens": 500, "ignore_eos": True},
        )
    _wait_until_idle(server)
    assert server.metric("tokenriver_kv_cache_blocks_used") == 0
    assert _aborted(server) - aborted_before == 1


def _wait_until_idle(server) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (
            server.metric("tokenriver_kv_cache_blocks_used") == 0
            and server.metric("tokenriver_num_requests_running") == 0
            and server.metric("tokenriver_num_requests_waiting") == 0
        ):
            return
        time.sleep(0.2)


def _aborted(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith('tokenriver_request_finished_total{finish_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0
