"""The visualizer's own routes over a stand-in engine: end-of-sequence ids, KV bytes per token, the pass log."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient

from tokenriver.engine.core import PassRow
from tokenriver.server.visualizer_api import add_visualizer_routes


def _client() -> TestClient:
    log = [
        (1, [PassRow("cmpl-a-0", 7, True), PassRow("cmpl-b-0", 5, True)]),
        (2, [PassRow("cmpl-a-0", 1, False), PassRow("cmpl-b-0", 1, False, num_draft_tokens=3)]),
    ]
    info = SimpleNamespace(
        eos_token_ids=(2, 0), vocab_size=100, block_size=16, kv_bytes_per_token=2 * 4 * 3 * 64 * 4 * 10 // 4
    )
    engine = SimpleNamespace(model_info=info, recent_passes=lambda since: [(n, rows) for n, rows in log if n > since])
    app = FastAPI()
    add_visualizer_routes(app, engine)
    return TestClient(app)


def test_info_gives_eos_ids_vocab_size_and_kv_bytes_per_token():
    info = _client().get("/v1/visualizer/info").json()
    # 10 layers' worth of K and V over 4 blocks of 16 slots: 2 * 4 * 3 * 64 * 4 * 10 / 4 bytes per slot.
    assert info == {
        "eos_token_ids": [2, 0],
        "vocab_size": 100,
        "block_size": 16,
        "kv_bytes_per_token": 2 * 4 * 3 * 64 * 4 * 10 // 4,
    }


def test_passes_lists_the_log_after_a_counter():
    client = _client()
    passes = client.get("/v1/visualizer/passes").json()["passes"]
    assert [p["pass"] for p in passes] == [1, 2]
    assert passes[0]["rows"][0] == {"request_id": "cmpl-a-0", "num_tokens": 7, "is_prompt": True, "num_draft_tokens": 0}
    assert passes[1]["rows"][1]["num_draft_tokens"] == 3
    assert [p["pass"] for p in client.get("/v1/visualizer/passes?since=1").json()["passes"]] == [2]
    assert client.get("/v1/visualizer/passes?since=2").json()["passes"] == []
