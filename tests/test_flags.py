"""Flags generated from config fields: every EngineConfig and ServerConfig knob has help in its metadata and a
flag with a readable metavar on every command that takes it, and the flags' text reaches the configs intact."""

from __future__ import annotations

import dataclasses

import pytest

from tokenriver.cli import build_parser, engine_config_from
from tokenriver.config import EngineConfig
from tokenriver.errors import InvalidParameterError
from tokenriver.server.cli_serve import server_config_from
from tokenriver.server.config import ServerConfig


def _help(command: str) -> str:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    return subparsers.choices[command].format_help()


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "visualize"])
def test_every_engine_field_is_a_flag_with_its_help(command):
    text = _help(command)
    for field in dataclasses.fields(EngineConfig):
        assert field.metadata.get("help"), f"EngineConfig.{field.name} has no help in its metadata"
        flag = "--" + field.metadata.get("flag", field.name.replace("_", "-"))
        assert flag in text, (command, flag)
    assert "--kv-cache-memory SIZE" in text and "--max-num-seqs N" in text
    assert "ENGINE_" not in text and "SAMPLING_" not in text and "SERVER_" not in text


def test_server_flags_come_from_server_config():
    text = _help("serve")
    flagged = [f for f in dataclasses.fields(ServerConfig) if f.metadata.get("help")]
    assert {f.name for f in dataclasses.fields(ServerConfig)} - {f.name for f in flagged} == {"static_dir"}
    for field in flagged:
        assert "--" + field.name.replace("_", "-") in text
    assert "--max-body-size SIZE" in text and "--port PORT" in text


@pytest.mark.parametrize(
    "size, expected", [("1GiB", 1024**3), ("512MiB", 512 * 1024**2), ("16MiB", 16 * 1024**2), ("1000000", 10**6)]
)
def test_kv_cache_memory_takes_sizes_on_every_command(size, expected):
    for argv in (["serve", "--kv-cache-memory", size], ["generate", "hi", "--kv-cache-memory", size]):
        assert engine_config_from(build_parser().parse_args(argv)).kv_cache_memory == expected


def test_server_flags_reach_server_config(monkeypatch):
    monkeypatch.setenv("TOKENRIVER_API_KEY", "from-env")
    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "0",
            "--allowed-origins",
            "http://a,http://b",
            "--allowed-origins",
            "http://c",
            "--max-body-size",
            "1MiB",
        ]
    )
    config = server_config_from(args)
    assert config == ServerConfig(
        port=0, api_key="from-env", allowed_origins=("http://a", "http://b", "http://c"), max_body_size=1024**2
    )


def test_both_sizes_of_the_kv_pool_are_refused_together():
    with pytest.raises(InvalidParameterError, match="give one of them") as caught:
        EngineConfig(kv_cache_memory="1GiB", max_num_kv_tokens=4096)
    assert caught.value.param == "kv_cache_memory"
    args = build_parser().parse_args(["serve", "--kv-cache-memory", "1GiB", "--max-num-kv-tokens", "4096"])
    with pytest.raises(InvalidParameterError):
        engine_config_from(args)
