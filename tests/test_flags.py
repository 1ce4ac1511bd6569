"""Flags generated from config fields: every EngineConfig (parts included), SamplingParams and ServerConfig knob
has help in its metadata and a flag with a readable metavar on every command that takes it, and the flags' text
reaches the configs intact; flat names reach the part that declares them."""

from __future__ import annotations

import dataclasses

import pytest

from tokenriver.cli import build_parser, engine_config_from
from tokenriver.config import (
    CacheConfig,
    EngineConfig,
    NumericsConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenriver.errors import InvalidParameterError
from tokenriver.params import SamplingParams
from tokenriver.server.cli_serve import server_config_from
from tokenriver.server.config import ServerConfig


def _help(command: str) -> str:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    return subparsers.choices[command].format_help()


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "visualize"])
def test_every_engine_field_is_a_flag_with_its_help(command):
    text = _help(command)
    for field in EngineConfig.flat_fields().values():
        assert field.metadata.get("help"), f"EngineConfig's {field.name} has no help in its metadata"
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
        assert engine_config_from(build_parser().parse_args(argv)).cache.kv_cache_memory == expected


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
        EngineConfig.from_flat(kv_cache_memory="1GiB", max_num_kv_tokens=4096)
    assert caught.value.param == "kv_cache_memory"
    args = build_parser().parse_args(["serve", "--kv-cache-memory", "1GiB", "--max-num-kv-tokens", "4096"])
    with pytest.raises(InvalidParameterError):
        engine_config_from(args)


def test_flat_names_reach_the_part_that_declares_them():
    parts = EngineConfig.parts()
    assert list(parts) == ["numerics", "cache", "scheduler", "speculative", "parallel"]
    num_fields = sum(len(dataclasses.fields(part)) for part in parts.values())
    num_own = len(dataclasses.fields(EngineConfig)) - len(parts)
    assert len(EngineConfig.flat_fields()) == num_own + num_fields  # no name declared twice
    config = EngineConfig.from_flat(
        model="m.gguf", dtype="bfloat16", block_size=32, max_num_seqs=8, ngram_min=1, num_threads=3
    )
    assert (config.model, config.numerics.dtype, config.cache.block_size) == ("m.gguf", "bfloat16", 32)
    assert (config.scheduler.max_num_seqs, config.speculative.ngram_min, config.parallel.num_threads) == (8, 1, 3)
    assert config == EngineConfig(
        model="m.gguf",
        numerics=NumericsConfig(dtype="bfloat16"),
        cache=CacheConfig(block_size=32),
        scheduler=SchedulerConfig(max_num_seqs=8),
        speculative=SpeculativeConfig(ngram_min=1),
        parallel=ParallelConfig(num_threads=3),
    )


def test_unknown_flat_names_and_cross_part_rules_are_refused():
    with pytest.raises(InvalidParameterError, match="unknown engine option") as caught:
        EngineConfig.from_flat(max_num_seq=8)
    assert caught.value.param == "max_num_seq"
    with pytest.raises(InvalidParameterError, match="unknown engine option"):
        EngineConfig.from_flat(cache=CacheConfig())  # parts are built from their fields' names
    with pytest.raises(InvalidParameterError) as caught:
        EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=8), cache=CacheConfig(block_size=16))
    assert caught.value.param == "max_num_batched_tokens"


def test_engine_flags_are_grouped_by_part_and_reach_it():
    text = _help("generate")
    for name in EngineConfig.parts():
        assert f"engine options: {name}:" in text
    args = build_parser().parse_args(["generate", "hi", "--max-num-seqs", "8", "--speculative-draft", "ngram"])
    config = engine_config_from(args)
    assert (config.scheduler.max_num_seqs, config.speculative.speculative_draft) == (8, "ngram")


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_sampling_flags_take_their_help_from_the_fields(command):
    text = " ".join(_help(command).split())
    flagged = [f for f in dataclasses.fields(SamplingParams) if f.metadata.get("help")]
    unflagged = {f.name for f in dataclasses.fields(SamplingParams)} - {f.name for f in flagged}
    assert unflagged == {"trace_stages", "beam_trace", "structured_output"}
    for field in flagged:
        assert "--" + field.name.replace("_", "-") in text
        assert " ".join(field.metadata["help"].split()) in text, field.name
    assert "--max-tokens MAX_TOKENS most tokens to generate (default: 128)" in text  # the command line's default
