"""The visualizer's own routes over a stand-in engine: end-of-sequence ids, KV bytes per token, the pass log with
each pass's time and cost, the cost of a token, and bad query parameters refused in OpenAI's error shape."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tokenriver.engine.core import ModelInfo, PassLogEntry, PassRow
from tokenriver.engine.machine_rates import MachineRates
from tokenriver.engine.token_cost import TokenCost
from tokenriver.server.app import build_app
from tokenriver.server.config import ServerConfig
from tokenriver.server.visualizer_api import add_visualizer_routes

KV_BYTES_PER_TOKEN = 2 * 4 * 3 * 64 * 4 * 10 // 4
COST = TokenCost(
    num_parameters=1_000_000,
    multiply_adds_per_token=900_000,
    output_multiply_adds=100_000,
    attention_multiply_adds_per_position=2 * 10 * 4 * 64,
    weight_bytes_per_pass=600_000,
    kv_bytes_per_token=KV_BYTES_PER_TOKEN,
)
RATES = MachineRates("cpu", 2, read_bytes_per_second=20e9, flops_per_second=100e9, seconds=0.2)
LOG = [
    PassLogEntry(
        1,
        [
            PassRow("cmpl-a-0", 7, True, num_context_tokens=7, num_logit_rows=1),
            PassRow("cmpl-b-0", 5, True, num_context_tokens=5, num_logit_rows=1),
        ],
        seconds=0.03,
    ),
    PassLogEntry(
        2,
        [
            PassRow("cmpl-a-0", 1, False, num_context_tokens=8, num_logit_rows=1),
            PassRow("cmpl-b-0", 1, False, num_draft_tokens=3, num_context_tokens=9, num_logit_rows=4),
        ],
        seconds=0.01,
    ),
]


def _engine() -> SimpleNamespace:
    info = SimpleNamespace(
        eos_token_ids=(2, 0),
        vocab_size=100,
        block_size=16,
        kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        max_model_len=64,
        token_cost=COST,
    )
    measured: concurrent.futures.Future = concurrent.futures.Future()
    measured.set_result(RATES)
    return SimpleNamespace(
        model_info=info,
        recent_passes=lambda since: [entry for entry in LOG if entry.num_forward_passes > since],
        machine_rates=lambda: measured,
    )


def _client() -> TestClient:
    app = FastAPI()
    add_visualizer_routes(app, _engine())
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
    assert passes[0]["rows"][0] == {
        "request_id": "cmpl-a-0",
        "num_tokens": 7,
        "is_prompt": True,
        "num_draft_tokens": 0,
        "num_context_tokens": 7,
        "num_logit_rows": 1,
    }
    assert passes[1]["rows"][1]["num_draft_tokens"] == 3
    assert [p["pass"] for p in client.get("/v1/visualizer/passes?since=1").json()["passes"]] == [2]
    assert client.get("/v1/visualizer/passes?since=2").json()["passes"] == []


def test_each_pass_has_its_time_tokens_and_cost():
    prefill, decode = _client().get("/v1/visualizer/passes").json()["passes"]
    assert (prefill["seconds"], prefill["num_passes"], prefill["num_tokens"]) == (0.03, 1, 12)
    assert (decode["seconds"], decode["num_tokens"]) == (0.01, 5)  # two decode tokens and three drafts
    # The weights once, and the K/V of each row's context.
    assert prefill["bytes_read"] == 600_000 + (7 + 5) * KV_BYTES_PER_TOKEN
    assert decode["bytes_read"] == 600_000 + (8 + 9) * KV_BYTES_PER_TOKEN
    # Layers per token, the output layer per logit row, attention per (query, position) pair: causal, so a prompt
    # of n tokens has n(n+1)/2 pairs; a decode row its context; 4 rows ending at position 9 have 6 + 7 + 8 + 9.
    per_position = 2 * 10 * 4 * 64
    assert prefill["multiply_adds"] == 12 * 800_000 + 2 * 100_000 + (28 + 15) * per_position
    assert decode["multiply_adds"] == 5 * 800_000 + 5 * 100_000 + (8 + 30) * per_position


def test_cost_gives_the_token_cost_the_bytes_at_a_context_and_the_machine():
    cost = _client().get("/v1/visualizer/cost?context=10").json()
    assert cost["num_parameters"] == 1_000_000
    assert cost["multiply_adds_per_token"] == 900_000
    assert cost["weight_bytes_per_pass"] == 600_000
    assert cost["bytes_per_pass"] == 600_000 + 10 * KV_BYTES_PER_TOKEN
    assert cost["machine"] == {
        "device": "cpu",
        "num_threads": 2,
        "read_bytes_per_second": 20e9,
        "flops_per_second": 100e9,
        "ridge_intensity": 5.0,
        "seconds": 0.2,
    }
    assert _client().get("/v1/visualizer/cost").json()["bytes_per_pass"] == 600_000


@pytest.mark.parametrize(
    ("path", "param"),
    [
        ("/v1/visualizer/cost?context=-1", "context"),
        ("/v1/visualizer/cost?context=65", "context"),
        ("/v1/visualizer/cost?context=ten", "query.context"),
        ("/v1/visualizer/passes?since=last", "query.since"),
    ],
)
def test_bad_query_parameters_get_a_400_naming_them(path: str, param: str):
    # The whole app, for its one error table: a bad query parameter is a 400 in OpenAI's shape, naming it.
    engine = _engine()
    engine.model_info = ModelInfo(
        path="/models/tiny-model.gguf",
        vocab_size=1000,
        max_model_len=64,
        num_parameters=1000,
        num_bytes=4000,
        weights="1000 parameters",
        dtype="float32",
        kv_cache_dtype="float32",
        block_size=16,
        num_kv_blocks=64,
        kv_cache_bytes=1 << 20,
        max_num_batched_tokens=256,
        max_num_seqs=64,
        max_waiting_requests=64,
        speculative_draft=None,
        num_speculative_tokens=4,
        token_cost=COST,
    )
    engine.tokenizer = SimpleNamespace(eos_token_ids=[0], chat_template=None)
    client = TestClient(build_app(engine, ServerConfig()), raise_server_exceptions=False)
    response = client.get(path)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert error["message"]
