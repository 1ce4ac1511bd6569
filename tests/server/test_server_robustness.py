"""Extreme but valid sampling values: each request gets 200 or 400, and the engine stays alive for the next.

On its own server, because a value that kills the engine would fail every later test of a shared one.
"""

from __future__ import annotations

import httpx
import pytest
from server_harness import start_server, stop_server

EXTREME_VALUES = [
    {"temperature": 1e-30},
    {"temperature": 1e300},
    {"repetition_penalty": 1e300},
    {"min_p": 1e-300},
    {"top_k": 2**63 - 1},
    {"seed": 2**63 - 1, "n": 2, "temperature": 1.0},
    {"seed": -2**63},
    {"logit_bias": {"5": 100, "6": -100}},
    {"frequency_penalty": 2, "presence_penalty": -2, "repetition_penalty": 2.0},
    # Values that underflow to 0 in float32: greedy / keep the top token / a clear 400.
    {"top_p": 1e-300},
    {"temperature": 1e-300},
    {"repetition_penalty": 1e-300},
]


@pytest.fixture(scope="module")
def own_server():
    started = start_server()
    yield started
    stop_server(started)


@pytest.mark.parametrize("values", EXTREME_VALUES)
def test_extreme_values_never_kill_the_engine(own_server, values):
    response = httpx.post(own_server.url + "/v1/completions", headers=own_server.headers(), timeout=60,
                          json={"prompt": "Hi there", "max_tokens": 3, **values})
    assert response.status_code in (200, 400), response.text
    assert httpx.get(own_server.url + "/health", timeout=10).status_code == 200
