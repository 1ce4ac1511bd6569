"""Loader tests keep GGUF header indexes in a temporary cache, not in the user's ~/.cache/tokenriver."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _temporary_gguf_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg_cache"))
