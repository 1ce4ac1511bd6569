"""AsyncEngine: the core is built on the thread that steps it, and a load error reaches the caller."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tokenriver.config import EngineConfig
from tokenriver.engine import async_engine
from tokenriver.engine.async_engine import AsyncEngine
from tokenriver.errors import ModelLoadError
from tokenriver.params import SamplingParams


def _engine_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "tokenriver-engine"]


def test_the_core_is_built_and_stepped_on_the_engine_thread(monkeypatch, default_model_path):
    # One thread does all of the engine's OpenMP work (the load's and the steps'), so that OpenMP keeps one pool.
    threads: dict[str, set[str]] = {"built": set(), "stepped": set()}

    class RecordingCore(async_engine.EngineCore):
        def __init__(self, *args, **kwargs) -> None:
            threads["built"].add(threading.current_thread().name)
            super().__init__(*args, **kwargs)

        def step(self):
            threads["stepped"].add(threading.current_thread().name)
            return super().step()

    monkeypatch.setattr(async_engine, "EngineCore", RecordingCore)
    engine = AsyncEngine(EngineConfig.from_flat(model=default_model_path, max_num_kv_tokens=1024))
    assert engine.model_info.max_model_len > 0 and engine.tokenizer is not None

    async def generate() -> list[int]:
        outputs = [output async for output in engine.generate([1, 2, 3], SamplingParams(max_tokens=4))]
        return outputs[-1].outputs[0].token_ids

    try:
        assert len(asyncio.run(generate())) == 4
    finally:
        engine.shutdown(timeout=10)
    assert threads == {"built": {"tokenriver-engine"}, "stepped": {"tokenriver-engine"}}


def test_a_load_error_is_raised_in_the_callers_thread_and_leaves_no_engine_thread(tmp_path):
    before = len(_engine_threads())
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        AsyncEngine(EngineConfig.from_flat(model=str(tmp_path / "missing.gguf")))
    assert len(_engine_threads()) == before


def test_the_machine_is_measured_once_on_the_engine_thread(monkeypatch, loaded_packed):
    measured_on: list[str] = []
    measure = async_engine.measure_machine_rates

    def recording_measure(device: str):
        measured_on.append(threading.current_thread().name)
        return measure(device)

    monkeypatch.setattr(async_engine, "measure_machine_rates", recording_measure)
    engine = AsyncEngine(EngineConfig.from_flat(max_num_kv_tokens=1024), loaded_packed)
    try:
        first = engine.machine_rates()
        assert engine.machine_rates() is first
        assert first.result(timeout=30).read_bytes_per_second > 0
    finally:
        engine.shutdown(timeout=10)
    assert measured_on == ["tokenriver-engine"]
