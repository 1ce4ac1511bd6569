"""The app in process over a stand-in engine (no model): CORS, auth, body limit, request ids, static files,
/v1/engine and /metrics from the scheduler's stats, and a crash turned into a logged 500."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from tokenriver.engine.async_engine import EngineSnapshot
from tokenriver.engine.core import ModelInfo
from tokenriver.errors import EngineOverloadedError
from tokenriver.outputs import CompletionOutput, FinishReason, RequestMetrics, RequestOutput
from tokenriver.sched.output import SchedulerStats
from tokenriver.server.app import build_app
from tokenriver.server.config import ServerConfig

STATS = SchedulerStats(
    num_running=3,
    num_waiting=2,
    num_preempted_total=5,
    num_blocks_total=64,
    num_blocks_used=16,
    num_blocks_free=48,
    kv_usage=0.25,
    prefix_cache_queried_tokens=100,
    prefix_cache_hit_tokens=40,
    prefix_cache_hit_rate=0.4,
    num_prefill_tokens_last_step=0,
    num_decode_tokens_last_step=3,
    num_prefill_tokens_total=90,
    num_decode_tokens_total=30,
    num_steps=33,
)


class CharTokenizer:
    """One token per character: id = code point."""

    eos_token_ids = [0]
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if "crash" in text:
            raise RuntimeError("tokenizer bug")
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids)

    def token_text(self, token_id: int) -> str:
        return chr(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" * add_generation_prompt)


MODEL_INFO = ModelInfo(
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
)


def _engine(stats: SchedulerStats = STATS) -> SimpleNamespace:
    """The engine's public surface, all the server may use: model_info, snapshot(), tokenizer, generate/abort."""
    return SimpleNamespace(
        model_info=MODEL_INFO,
        tokenizer=CharTokenizer(),
        max_model_len=64,
        is_running=True,
        snapshot=lambda: EngineSnapshot(stats, num_forward_passes=77),
    )


@pytest.fixture()
def static_dir(tmp_path):
    (tmp_path / "index.html").write_text("<html>visualizer</html>")
    (tmp_path / "app.js").write_text("console.log(1)")
    return tmp_path


def _client(**config) -> TestClient:
    return TestClient(build_app(_engine(), ServerConfig(**config)), raise_server_exceptions=False)


def test_api_key_guards_the_api_but_not_health_metrics_or_visualizer(static_dir):
    client = _client(api_key="k", static_dir=str(static_dir))
    assert client.get("/v1/models").status_code == 401
    assert client.post("/tokenize", json={"prompt": "ab"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][0]["id"] == "tiny-model"
    for path in ("/health", "/version", "/metrics", "/", "/static/app.js"):
        assert client.get(path).status_code == 200, path


def test_cors_is_off_unless_origins_are_allowed():
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
    response = _client().options("/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in response.headers
    client = _client(allowed_origins=("http://ui.example",), api_key="k")
    response = client.options("/v1/completions", headers=preflight)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "http://ui.example"
    response = client.get("/v1/models", headers={"Origin": "http://ui.example", "Authorization": "Bearer k"})
    assert response.headers["access-control-allow-origin"] == "http://ui.example"
    assert "x-request-id" in response.headers["access-control-expose-headers"].lower()
    response = client.get("/v1/models", headers={"Origin": "http://evil.example", "Authorization": "Bearer k"})
    assert "access-control-allow-origin" not in response.headers


def test_body_over_the_limit_is_413_before_parsing():
    response = _client(max_body_size=2048).post(
        "/v1/completions", content=b"x" * 4096, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_tokenize_and_detokenize():
    client = _client()
    body = client.post("/tokenize", json={"prompt": "hi"}).json()
    assert body == {"tokens": [104, 105], "count": 2, "max_model_len": 64, "token_strs": ["h", "i"]}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "yo"}]}).json()
    assert chat["count"] == len("<user>yo<assistant>")
    assert client.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    error = client.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]}).json()
    assert error["error"]["param"] == "prompt"


def test_engine_info_and_metrics_read_the_published_snapshot():
    client = _client()
    info = client.get("/v1/engine").json()
    assert info == {
        "model": "tiny-model",
        "dtype": "float32",
        "kv_cache_dtype": "float32",
        "block_size": 16,
        "num_blocks": 64,
        "num_blocks_used": 16,
        "num_blocks_free": 48,
        "kv_usage": 0.25,
        "num_running": 3,
        "num_waiting": 2,
        "num_preemptions": 5,
        "prefix_cache_hit_rate": 0.4,
        "num_forward_passes": 77,
        "max_model_len": 64,
        "max_num_batched_tokens": 256,
        "max_num_seqs": 64,
        "max_waiting_requests": 64,
    }
    text = client.get("/metrics").text
    for line in (
        "tokenriver_num_requests_running 3.0",
        "tokenriver_num_requests_waiting 2.0",
        "tokenriver_kv_cache_usage_ratio 0.25",
        "tokenriver_kv_cache_blocks_used 16.0",
        "tokenriver_prefix_cache_hit_rate 0.4",
        "tokenriver_num_preemptions_total 5.0",
        'tokenriver_http_requests_total{endpoint="/v1/engine",status="200"} 1.0',
    ):
        assert line in text, line
    for family in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "prompt_tokens_total",
        "generation_tokens_total",
    ):
        assert f"tokenriver_{family}" in text


def test_two_apps_keep_separate_registries():
    first, second = _client(), _client()
    first.get("/v1/models")
    assert 'endpoint="/v1/models"' not in second.get("/metrics").text


def test_request_ids_are_echoed_or_generated():
    client = _client()
    assert client.get("/health", headers={"X-Request-Id": "abc-123"}).headers["x-request-id"] == "abc-123"
    generated = client.get("/health").headers["x-request-id"]
    assert len(generated) == 32 and generated != client.get("/health").headers["x-request-id"]


def test_a_crash_is_a_logged_500_in_openai_shape(caplog):
    response = _client().post("/tokenize", json={"prompt": "crash"}, headers={"X-Request-Id": "crash-1"})
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"
    assert "crash-1" in response.json()["error"]["message"]
    assert "tokenizer bug" not in response.text
    assert any("crash-1" in record.getMessage() and record.exc_info for record in caplog.records)


def test_visualizer_missing_is_a_404_in_openai_shape(tmp_path):
    response = _client(static_dir=str(tmp_path)).get("/")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


def test_dead_engine_fails_health_with_503():
    engine = _engine()
    engine.is_running = False
    client = TestClient(build_app(engine, ServerConfig()))
    assert client.get("/health").status_code == 503


def test_served_model_name_overrides_the_file_stem():
    client = TestClient(build_app(_engine(), dataclasses.replace(ServerConfig(), served_model_name="mine")))
    assert client.get("/v1/models").json()["data"][0]["id"] == "mine"
    assert client.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


def test_a_full_waiting_queue_is_429_with_retry_after_and_counted():
    async def overloaded(*args, **kwargs):
        raise EngineOverloadedError("64 requests are already waiting (max_waiting_requests)")
        yield  # an async generator, as AsyncEngine.generate is

    engine = _engine()
    engine.generate = overloaded
    client = TestClient(build_app(engine, ServerConfig()), raise_server_exceptions=False)
    for body in ({"prompt": "hi", "max_tokens": 2}, {"prompt": "hi", "max_tokens": 2, "stream": True}):
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 429, response.text
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "server_overloaded"
    text = client.get("/metrics").text
    assert "tokenriver_requests_rejected_total 2.0" in text
    assert 'finish_reason="abort"' not in text  # a refusal is not an abort


def test_streamed_text_with_unicode_line_separators_stays_one_event_per_line():
    # JSON leaves U+0085, U+2028 and U+2029 raw, and line readers built on str.splitlines (httpx's) split on them.
    text = "a\x85b\u2028c\u2029d"

    async def generate(prompt_token_ids, params, request_id=None, prompt=None, priority=0):
        for index, token in enumerate(text):
            finished = index == len(text) - 1
            yield RequestOutput(
                request_id=request_id or "r",
                prompt=prompt,
                prompt_token_ids=list(prompt_token_ids),
                outputs=[
                    CompletionOutput(
                        index=0,
                        text=text[: index + 1],
                        token_ids=[ord(c) for c in text[: index + 1]],
                        delta_text=token,
                        delta_token_ids=[ord(token)],
                        finish_reason=FinishReason.LENGTH if finished else None,
                    )
                ],
                finished=finished,
                metrics=RequestMetrics(arrival_time=0.0),
            )

    engine = _engine()
    engine.generate = generate
    engine.abort = lambda request_id: None
    client = TestClient(build_app(engine, ServerConfig()), raise_server_exceptions=False)
    body = {"prompt": "hi", "max_tokens": len(text), "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(choice["text"] for event in events for choice in event["choices"]) == text
