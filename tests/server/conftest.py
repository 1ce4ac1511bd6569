"""The shared server of the server tests: started once per session, since loading the model takes most of the
time; tests that must kill their server start their own with server_harness.start_server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_harness import ServerProcess, start_server, stop_server


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    # The defaults, as `tokenriver serve` runs with no flags: its tests compare requests with each other (a stream
    # with its non-streamed twin, the same seed twice, requests sent together and one by one), bit for bit.
    started = start_server()
    yield started
    stop_server(started)
