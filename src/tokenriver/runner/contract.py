"""What a runner offers the engine: declared here, so the engine calls methods instead of probing for them.

Two classes keep it: runner/model_runner.py's ModelRunner (one process), and distributed/runner.py's
TensorParallelRunner (rank 0 of a tensor-parallel group, which sends each step's plan to the other ranks before
running its own shard). The engine holds either as a `Runner` and uses nothing else of it.
tests/runner/test_runner_contract.py checks both against it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from tokenriver.sched.output import RunnerOutput, SchedulerOutput


@runtime_checkable
class Runner(Protocol):
    """Turns each step's plan into sampled tokens."""

    @property
    def num_forward_passes(self) -> int:
        """Forward passes of the model run so far (a multi-step step counts each of its passes)."""
        ...

    def execute(
        self, scheduler_output: SchedulerOutput, draft_probs: dict[str, torch.Tensor] | None = None
    ) -> RunnerOutput:
        """Run the step's one forward pass (and its further greedy passes) and sample; draft_probs: request id →
        [num_drafts, vocab] distributions its draft tokens were drawn from (draft models only)."""
        ...

    def close(self) -> None:
        """Release what would outlive a garbage collection (threads, other processes). Idempotent."""
        ...
