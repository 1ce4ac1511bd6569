"""Bad requests over raw HTTP: each gets its status and OpenAI's error shape, and none gets a 500."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import MAX_BODY_SIZE, MAX_MODEL_LEN


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=60) as client:
        yield client


def _error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    """Check status and shape; return the error object."""
    assert response.status_code == status, response.text
    assert response.headers["x-request-id"]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def _post(http: httpx.Client, path: str, body: object) -> httpx.Response:
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def test_malformed_json_is_400(http):
    error = _error(http.post("/v1/completions", content=b'{"prompt": "hi",'), 400)
    assert "JSON" in error["message"]
    _error(http.post("/v1/chat/completions", content=b"\xff\xfe"), 400)
    _error(_post(http, "/v1/completions", ["not", "an", "object"]), 400)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {"prompt": 42}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], "mixed"]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stop": [1, 2]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"12": "high"}}, "logit_bias.12"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/chat/completions", {"messages": "hello"}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
        ("/v1/completions", {"prompt": "hi", "top_k": -(2**70)}, "top_k"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
    ],
)
def test_wrong_types_are_400_naming_the_field(http, path, body, param):
    _error(_post(http, path, body), 400, param)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "hi", "n": 2, "temperature": 0}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "best_of": 1, "n": 2}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
        ("/v1/completions", {"prompt": "hi", "frequency_penalty": -2.5}, "frequency_penalty"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 500}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "top_k": -5}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "min_p": 2}, "min_p"),
        ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**7]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "trace_top": 0}, "trace_top"),
        ("/v1/completions", {"prompt": "hi", "n": 1000, "temperature": 1}, "n"),
        ("/v1/completions", {"prompt": "hi", "best_of": 1000, "temperature": 1}, "best_of"),
        ("/v1/completions", {"prompt": [10**7]}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 30, "logprobs": True},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "max_completion_tokens": 6},
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1},
            "max_completion_tokens",
        ),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [10**7]}, "tokens"),
    ],
)
def test_out_of_range_values_are_400_naming_the_field(http, path, body, param):
    _error(_post(http, path, body), 400, param, "invalid_value")


def test_unknown_fields_are_rejected_and_named(http):
    error = _error(
        _post(http, "/v1/completions", {"prompt": "hi", "temprature": 0.5, "frobnicate": 1}),
        400,
        "temprature",
        "unknown_parameter",
    )
    assert "'temprature'" in error["message"] and "'frobnicate'" in error["message"]
    _error(
        _post(
            http,
            "/v1/completions",
            {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True, "extra": 1}},
        ),
        400,
        "stream_options.extra",
    )
    _error(
        _post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "mood": "x"}]}),
        400,
        "messages[0].mood",
    )


def test_noop_openai_fields_are_accepted_only_when_off(http):
    body = {"prompt": "hi", "max_tokens": 1, "user": "someone", "store": False, "metadata": {"a": "b"}, "suffix": None}
    assert _post(http, "/v1/completions", body).status_code == 200
    chat = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": []},
            {"role": "user", "content": [{"type": "text", "text": "again"}]},
        ],
        "max_tokens": 1,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
    }
    assert _post(http, "/v1/chat/completions", chat).status_code == 200
    _error(_post(http, "/v1/chat/completions", {**chat, "functions": [{"name": "f"}]}), 400, "functions")
    _error(_post(http, "/v1/chat/completions", {**chat, "tools": [{"type": "function"}]}), 400, "tools[0].function")
    _error(_post(http, "/v1/completions", {"prompt": "hi", "suffix": "end"}), 400, "suffix")


def test_unknown_model_is_404(http):
    error = _error(_post(http, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 404, "model", "model_not_found")
    assert error["type"] == "not_found_error"
    _error(http.get("/v1/models/gpt-9"), 404, "model")


def test_unknown_route_is_404_and_wrong_method_405(http):
    assert _error(http.get("/v1/nothing-here"), 404)["type"] == "not_found_error"
    _error(http.get("/v1/completions"), 405)


def test_missing_or_wrong_api_key_is_401(server):
    body = {"prompt": "hi", "max_tokens": 1}
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Basic " + server.api_key},
        {"Authorization": "Bearer " + server.api_key + "x"},
    ):
        response = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert _error(response, 401)["type"] == "authentication_error"
    _error(httpx.post(server.url + "/tokenize", json={"prompt": "hi"}, timeout=30), 401)
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=30).status_code == 200


def test_oversized_body_is_413(http):
    big = {"prompt": "a" * (MAX_BODY_SIZE + 10)}
    _error(_post(http, "/v1/completions", big), 413, code="request_too_large")

    def chunks():
        data = json.dumps(big).encode()
        for start in range(0, len(data), 4096):
            yield data[start : start + 4096]

    # Without Content-Length (chunked upload) the limit is enforced while reading.
    _error(http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413)


def test_too_long_prompt_is_400_with_both_token_counts(http):
    ids = [100] * (MAX_MODEL_LEN + 10)
    error = _error(_post(http, "/v1/completions", {"prompt": ids}), 400, "prompt", "context_length_exceeded")
    assert str(MAX_MODEL_LEN + 10) in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    error = _error(
        _post(http, "/v1/completions", {"prompt": [100] * 500, "max_tokens": 20}),
        400,
        "max_tokens",
        "context_length_exceeded",
    )
    assert "520" in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    error = _error(
        _post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 600}]}),
        400,
        "messages",
        "context_length_exceeded",
    )
    assert str(MAX_MODEL_LEN) in error["message"]
    _error(_post(http, "/v1/completions", {"prompt": ids, "stream": True}), 400, "prompt", "context_length_exceeded")


def test_request_id_is_echoed(http):
    response = http.get("/health", headers={"X-Request-Id": "my-id-42"})
    assert response.headers["x-request-id"] == "my-id-42"
    assert http.get("/health", headers={"X-Request-Id": "bad id\twith spaces"}).headers["x-request-id"] != ""


_INTEGERS = st.integers(-3, 5) | st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1, 10**30])
_JSON = st.recursive(
    st.none() | st.booleans() | _INTEGERS | st.floats(allow_nan=True) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
_FIELDS = [
    "prompt",
    "messages",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "echo",
    "best_of",
    "stream",
    "stream_options",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
    "trace",
    "trace_top",
    "priority",
    "skip_special_tokens",
    "model",
    "chat_template_kwargs",
    "tools",
    "user",
]


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), name=st.sampled_from(_FIELDS), value=_JSON)
def test_no_user_input_causes_a_500(http, path, name, value):
    body = (
        {"max_tokens": 1, "prompt": "Hi"}
        if path == "/v1/completions"
        else {"max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    )
    body[name] = value
    response = http.post(path, content=json.dumps(body, allow_nan=True), headers={"Content-Type": "application/json"})
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        _error(response, response.status_code)


def test_metrics_saw_no_500(server):
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'status="400"' in text
    assert 'status="500"' not in text
