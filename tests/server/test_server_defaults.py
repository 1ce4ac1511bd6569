"""A server started with no numerics flags runs the fast defaults: packed weights, int8-rounded activations and an
int8 KV pool, and says so in its startup line."""

from __future__ import annotations

import httpx


def test_default_server_runs_and_reports_the_fast_settings(server):
    log = server.log()
    assert "int8)" in log and "int4 per 32" in log and "file types: F32" in log, log
    reply = httpx.post(
        server.url + "/v1/completions",
        headers=server.headers(),
        json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
