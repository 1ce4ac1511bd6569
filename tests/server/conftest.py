"""The shared server of the server tests: started once per session, since loading the model takes most of the
time; tests that must kill their server start their own with server_harness.start_server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_harness import ServerProcess, start_server, stop_server


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    started = start_server()
    yield started
    stop_server(started)
