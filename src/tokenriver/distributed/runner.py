"""The runner side of tensor parallelism: rank 0 plans, every rank runs the same forward pass on its shard.

Rank 0 holds the scheduler. Before each step it broadcasts the step's SchedulerOutput (plain data) to the other
ranks, then runs its own shard; the others wait in `serve_steps` for the next plan and run theirs. The sharded
layers all-reduce inside the forward pass (distributed/sharding.py), so every rank ends a pass with the same hidden
states; only rank 0's sampled tokens are used. A None plan tells the other ranks to stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tokenriver.distributed.group import TensorParallelGroup
from tokenriver.runner.model_runner import ModelRunner
from tokenriver.sched.output import RunnerOutput, SchedulerOutput


class Joinable(Protocol):
    def join(self, timeout: float | None = None) -> None: ...


class TensorParallelRunner:
    """Rank 0's runner (runner/contract.py's Runner): each step's plan sent to the other ranks, then run here."""

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup, workers: Sequence[Joinable] = ()) -> None:
        self.runner = runner
        self.group = group
        # The processes of this machine's other ranks, where rank 0 started them: joined on close.
        self.workers = list(workers)
        self._closed = False

    @property
    def num_forward_passes(self) -> int:
        """Forward passes run so far: rank 0's, which every rank runs in step."""
        return self.runner.num_forward_passes

    def execute(
        self, scheduler_output: SchedulerOutput, draft_probs: dict[str, torch.Tensor] | None = None
    ) -> RunnerOutput:
        self.group.broadcast(scheduler_output)
        return self.runner.execute(scheduler_output, draft_probs)

    def close(self) -> None:
        """Tell the other ranks to stop, leave the group, and close rank 0's own runner. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.group.broadcast(None)
        self.group.close()
        for worker in self.workers:
            worker.join(timeout=30)
        self.runner.close()


def serve_steps(runner: ModelRunner, group: TensorParallelGroup) -> int:
    """A rank other than 0: run each plan rank 0 broadcasts until it sends None; returns the steps run."""
    num_steps = 0
    while True:
        scheduler_output = group.broadcast()
        if scheduler_output is None:
            return num_steps
        runner.execute(scheduler_output)
        num_steps += 1
