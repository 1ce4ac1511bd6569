"""SIGTERM: stop accepting, let the in-flight request finish, exit 0."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from server_harness import start_server, stop_server

# Long enough (~3 s here) that SIGTERM always lands while the request is still generating: with 24 tokens it
# sometimes finished first, and then there was no connection for the server to wait for.
NUM_TOKENS = 256


@pytest.fixture(scope="module")
def own_server():
    started = start_server(["--shutdown-timeout", "60"])
    yield started
    stop_server(started)


def test_sigterm_lets_the_running_request_finish_then_exits_0(own_server):
    results: dict[str, httpx.Response] = {}

    def run_request() -> None:
        results["response"] = httpx.post(
            own_server.url + "/v1/completions",
            headers=own_server.headers(),
            timeout=120,
            json={"prompt": "Count: one, two,", "max_tokens": NUM_TOKENS, "ignore_eos": True, "temperature": 0},
        )

    thread = threading.Thread(target=run_request)
    thread.start()
    deadline = time.monotonic() + 30
    while own_server.metric("tokenriver_num_requests_running") < 1:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.05)
    own_server.process.send_signal(signal.SIGTERM)
    assert own_server.process.wait(timeout=90) == 0, own_server.log()
    thread.join(timeout=30)
    response = results["response"]
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == NUM_TOKENS
    assert response.json()["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.TransportError):
        httpx.get(own_server.url + "/health", timeout=5)
    log = own_server.log()
    assert "Waiting for connections to close" in log and "tokenriver server stopped" in log
