"""The shared server of the server tests: started once per session, since loading the model takes most of the
time; tests that must kill their server start their own with server_harness.start_server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_harness import ServerProcess, start_server, stop_server


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    # Its tests compare requests with each other (a stream with its non-streamed twin, the same seed twice), so it
    # runs the batch-invariant reference numerics: with int8-rounded activations a request's last prompt tokens
    # computed after a prefix-cache hit round differently from the same tokens inside a whole prompt.
    started = start_server(["--reference-numerics"])
    yield started
    stop_server(started)
