"""Both runners keep runner/contract.py's Runner, the only part of a runner the engine uses.

ModelRunner runs one process; TensorParallelRunner is rank 0 of a group and has no fallback to the runner it wraps:
whatever the engine calls it declares itself.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tokenriver.distributed.runner import TensorParallelRunner
from tokenriver.kv.cache import KVCache
from tokenriver.models.config import ModelConfig
from tokenriver.models.llama import LlamaForCausalLM
from tokenriver.runner.contract import Runner
from tokenriver.runner.model_runner import ModelRunner
from tokenriver.sched.output import RunnerOutput, SchedulerOutput


class FakeGroup:
    """A tensor-parallel group of one: records what rank 0 broadcasts."""

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.is_closed = False

    def broadcast(self, value: object = None) -> object:
        self.sent.append(value)
        return value

    def close(self) -> None:
        self.is_closed = True


@pytest.fixture
def model_runner() -> ModelRunner:
    config = ModelConfig("llama", 32, 16, 32, 1, 2, 1, 8, max_position_embeddings=64)
    torch.manual_seed(0)
    cache = KVCache(config.num_layers, 4, 16, config.num_kv_heads, config.head_dim, torch.float32, "cpu")
    return ModelRunner(LlamaForCausalLM(config), cache, "cpu")


def parameter_names(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def test_both_runners_are_runners(model_runner):
    parallel = TensorParallelRunner(model_runner, FakeGroup())
    for runner in (model_runner, parallel):
        assert isinstance(runner, Runner)
        assert parameter_names(type(runner).execute) == parameter_names(Runner.execute)
        assert isinstance(inspect.getattr_static(type(runner), "num_forward_passes"), property)
        assert runner.num_forward_passes == 0


def test_the_parallel_runner_broadcasts_each_plan_then_runs_it(model_runner):
    group = FakeGroup()
    parallel = TensorParallelRunner(model_runner, group)
    plan = SchedulerOutput(scheduled=[])
    assert parallel.execute(plan) == RunnerOutput()
    assert group.sent == [plan]
    parallel.close()
    parallel.close()
    assert group.sent == [plan, None] and group.is_closed


def test_the_parallel_runner_forwards_nothing_it_does_not_declare(model_runner):
    parallel = TensorParallelRunner(model_runner, FakeGroup())
    assert not hasattr(parallel, "sampler") and not hasattr(parallel, "kv_cache")
