"""One `tokenriver serve` and one Chromium for every visualizer test module that uses the default server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def base_url() -> Iterator[str]:
    """A real `tokenriver serve` with the default model on a free local port."""
    harness = pytest.importorskip("visualizer_harness")
    with harness.running_server() as url:
        yield url


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    harness = pytest.importorskip("visualizer_harness")
    with harness.chromium() as chromium:
        yield chromium
