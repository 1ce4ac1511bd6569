"""Without a model: request parsing, the mapping onto SamplingParams, the error table, configs and CLI flags."""

from __future__ import annotations

import argparse
import json

import pytest
from pydantic import ValidationError

from tokenriver.config import EngineConfig
from tokenriver.errors import ContextLengthError, EngineDeadError, EngineOverloadedError, InvalidParameterError
from tokenriver.params import SamplingParams
from tokenriver.server.app import ApiError, error_payload
from tokenriver.server.cli_serve import API_KEY_ENV, add_serve_command, server_config_from
from tokenriver.server.config import ServerConfig
from tokenriver.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from tokenriver.server.serving import sampling_params


def _parse(model, body: dict):
    return parse_request(model, json.dumps(body).encode())


def _completion_params(body: dict) -> SamplingParams:
    request = _parse(CompletionRequest, body)
    return sampling_params(
        request,
        max_tokens=request.max_tokens,
        max_tokens_param="max_tokens",
        logprobs=request.logprobs,
        logprobs_param="logprobs",
        prompt_logprobs=None,
        best_of=request.best_of,
    )


def test_every_sampling_field_reaches_sampling_params():
    params = _completion_params(
        {
            "prompt": "hi",
            "n": 2,
            "best_of": 3,
            "temperature": 0.7,
            "top_p": 0.9,
            "stop": ["\n", "END"],
            "seed": 11,
            "max_tokens": 33,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "logit_bias": {"42": -100, "7": 2.5},
            "logprobs": 4,
            "top_k": 40,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "stop_token_ids": [5, 6],
            "ignore_eos": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "trace": True,
            "trace_top": 7,
            "user": "ignored",
        }
    )
    assert params == SamplingParams(
        n=2,
        best_of=3,
        temperature=0.7,
        top_p=0.9,
        stop=["\n", "END"],
        seed=11,
        max_tokens=33,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={42: -100.0, 7: 2.5},
        logprobs=4,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        min_tokens=2,
        stop_token_ids=[5, 6],
        ignore_eos=True,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        trace=True,
        trace_top=7,
    )


def test_unset_and_null_fields_keep_sampling_defaults():
    assert _completion_params({"prompt": "hi", "temperature": None, "n": None, "stop": None}) == SamplingParams(
        max_tokens=None
    )
    assert _completion_params({"prompt": "hi", "stop": "x"}).stop == ["x"]


def test_sampling_errors_are_renamed_to_the_field_the_client_sent():
    request = _parse(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}
    )
    with pytest.raises(InvalidParameterError) as error:
        sampling_params(
            request,
            max_tokens=0,
            max_tokens_param="max_completion_tokens",
            logprobs=None,
            logprobs_param="top_logprobs",
            prompt_logprobs=None,
            best_of=None,
        )
    assert error.value.param == "max_completion_tokens"
    assert error.value.message.startswith("max_completion_tokens=0")
    with pytest.raises(InvalidParameterError) as error:
        sampling_params(
            request,
            max_tokens=5,
            max_tokens_param="max_completion_tokens",
            logprobs=30,
            logprobs_param="top_logprobs",
            prompt_logprobs=None,
            best_of=None,
        )
    assert error.value.param == "top_logprobs"


def test_logit_bias_keys_must_be_token_ids():
    with pytest.raises(InvalidParameterError) as error:
        _completion_params({"prompt": "hi", "logit_bias": {"hello": 1}})
    assert error.value.param == "logit_bias"


def test_strict_types_and_closed_models():
    for body in (
        {"prompt": "hi", "temperature": "0.5"},
        {"prompt": "hi", "n": 1.0},
        {"prompt": "hi", "echo": 1},
        {"prompt": "hi", "seed": True},
        {"prompt": "hi", "colour": "red"},
        {"prompt": [1, "a"]},
    ):
        with pytest.raises(ValidationError):
            _parse(CompletionRequest, body)
    assert _parse(CompletionRequest, {"prompt": "hi", "temperature": 1}).temperature == 1.0


def test_ignored_and_noop_fields():
    request = _parse(
        ChatCompletionRequest,
        {
            "messages": [{"role": "assistant", "content": "x", "refusal": None, "annotations": []}],
            "user": "u",
            "store": True,
            "metadata": {},
            "service_tier": "auto",
            "parallel_tool_calls": True,
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
        },
    )
    assert request.messages[0].text() == "x"
    for field, value in (("functions", [{"name": "f"}]), ("function_call", "auto")):
        with pytest.raises(InvalidParameterError) as error:
            _parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], field: value})
        assert error.value.param == field
    with pytest.raises(ValidationError):
        _parse(ChatCompletionRequest, {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{}]}]})


def test_malformed_bodies():
    for body in (b"{", b"[1, 2]", b"\xff", b'"text"'):
        with pytest.raises(InvalidParameterError):
            parse_request(CompletionRequest, body)


def test_text_parts_join_like_vllm():
    request = _parse(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
    )
    assert request.messages[0].text() == "a\nb"


def _validation_error(body: dict) -> ValidationError:
    with pytest.raises(ValidationError) as error:
        _parse(ChatCompletionRequest, body)
    return error.value


@pytest.mark.parametrize(
    "error, status, error_type, code, param",
    [
        (
            InvalidParameterError("top_p=2 is invalid", param="top_p"),
            400,
            "invalid_request_error",
            "invalid_value",
            "top_p",
        ),
        (
            ContextLengthError("too long", num_tokens=600, max_tokens=512),
            400,
            "invalid_request_error",
            "context_length_exceeded",
            "prompt",
        ),
        (
            ApiError(401, "wrong API key", "authentication_error", None, "invalid_api_key"),
            401,
            "authentication_error",
            "invalid_api_key",
            None,
        ),
        (EngineDeadError("the engine stopped"), 503, "server_error", "engine_dead", None),
        (EngineOverloadedError("1 requests are already waiting"), 429, "server_error", "server_overloaded", None),
        (RuntimeError("bug"), 500, "server_error", "internal_error", None),
    ],
)
def test_error_table(error, status, error_type, code, param):
    got_status, body = error_payload(error, "req-1")
    assert (got_status, body.error.type, body.error.code, body.error.param) == (status, error_type, code, param)


def test_internal_errors_name_the_request_id_and_are_logged(caplog):
    _, body = error_payload(RuntimeError("secret detail"), "req-77")
    assert "req-77" in body.error.message and "secret detail" not in body.error.message
    assert "req-77" in caplog.text and "secret detail" in caplog.text


def test_validation_errors_name_the_field_path():
    _, body = error_payload(_validation_error({"messages": [{"role": "user", "content": 3}]}), "r")
    assert body.error.param == "messages[0].content" and body.error.code == "invalid_type"
    _, body = error_payload(
        _validation_error({"messages": [{"role": "user", "content": "x"}], "zz": 1, "temperature": "a", "yy": 2}), "r"
    )
    assert body.error.param == "zz" and body.error.code == "unknown_parameter"
    assert "'zz'" in body.error.message and "'yy'" in body.error.message
    _, body = error_payload(_validation_error({}), "r")
    assert body.error.param == "messages" and body.error.code == "missing_required_parameter"


def test_server_config_validates_once():
    assert ServerConfig(max_body_size="1MiB").max_body_size == 1024**2
    for kwargs, param in (
        ({"port": 70000}, "port"),
        ({"api_key": ""}, "api_key"),
        ({"max_body_size": "lots"}, "max_body_size"),
        ({"max_body_size": 10}, "max_body_size"),
        ({"shutdown_timeout": -1}, "shutdown_timeout"),
        ({"log_level": "loud"}, "log_level"),
    ):
        with pytest.raises(InvalidParameterError) as error:
            ServerConfig(**kwargs)
        assert error.value.param == param


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(dest="command")

    def add_engine_flags(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--max-num-seqs", dest="engine_max_num_seqs", type=int, default=64)

    add_serve_command(
        subparsers, add_engine_flags, lambda args: EngineConfig.from_flat(max_num_seqs=args.engine_max_num_seqs)
    )
    return parser


def test_serve_flags_build_the_server_config(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    args = _parser().parse_args(
        [
            "serve",
            "--port",
            "0",
            "--allowed-origins",
            "http://a,http://b",
            "--allowed-origins",
            "http://c",
            "--max-num-seqs",
            "4",
            "--max-body-size",
            "2MiB",
        ]
    )
    config = server_config_from(args)
    assert config == ServerConfig(
        port=0, api_key="from-env", allowed_origins=("http://a", "http://b", "http://c"), max_body_size=2 * 1024**2
    )
    assert args.engine_max_num_seqs == 4 and callable(args.handler)
    args = _parser().parse_args(["visualize", "--api-key", "flag", "--no-browser"])
    assert server_config_from(args).api_key == "flag"
    monkeypatch.delenv(API_KEY_ENV)
    assert server_config_from(_parser().parse_args(["serve"])).api_key is None
