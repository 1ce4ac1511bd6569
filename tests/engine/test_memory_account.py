"""The engine's memory account (engine/memory.py) on the embedded model, in a fresh process: its parts add up to the
resident memory, and the load's peak is not above what the loaded model then holds.

The slack, 16 MiB: what a load holds only while it runs, each bounded by a constant of the loader, not by the model:
the file pages of one chunk being converted (loader/gguf.py's _CHUNK_BYTES, 4 MiB), the scratch of one slab of row
tiles (models/cpu/tiles.py) and of one re-packed chunk of a fused projection (loader/assemble.py), and heap pages
freed between two hand-backs to the OS. The account's own "other" part (the engine's objects, the heap the load
left behind) is held to the same bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tokenriver

SLACK_MIB = 16
pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")

_WORKER = """
import json
from tokenriver.engine.core import EngineCore
from tokenriver.config import EngineConfig
from tokenriver.process_memory import read_status
core = EngineCore(EngineConfig())
account = core.memory_account()
print(json.dumps({**account.__dict__, "line": core.model_info.memory, "resident_now": read_status().resident}))
"""


@pytest.fixture(scope="module")
def account(tmp_path_factory) -> dict:
    source_root = os.path.dirname(os.path.dirname(tokenriver.__file__))
    env = dict(os.environ, PYTHONPATH=source_root, XDG_CACHE_HOME=str(tmp_path_factory.mktemp("cache")))
    result = subprocess.run([sys.executable, "-c", _WORKER], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_parts_add_up_to_the_resident_memory(account):
    mib = 2**20
    parts = account["weights"] + account["kv_touched"] + account["tokenizer"] + account["runtime"]
    assert abs(account["resident"] - parts) <= SLACK_MIB * mib, account
    assert account["other"] == account["resident"] - parts
    # Every weight is a converted copy: nothing of the file stays mapped.
    assert account["weights_mapped_from_file"] == 0
    assert account["weights"] >= 88 * mib  # the embedded model's 92 MiB of packed weights
    # The pool is reserved (2 GiB by default), not written: an engine that has run nothing touched none of it.
    assert account["kv_reserved"] >= 1024 * mib and account["kv_touched"] <= 1 * mib


def test_the_load_peaks_no_higher_than_what_it_leaves_resident(account):
    assert account["peak_during_load"] <= account["resident_after_load"] + SLACK_MIB * 2**20, account


def test_the_startup_line_says_each_part(account):
    line = account["line"]
    for part in ("weights", "mapped from the file", "KV pool", "tokenizer", "runtime", "other", "RSS", "peak"):
        assert part in line, line
