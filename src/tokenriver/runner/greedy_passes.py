"""GreedyPasses: the passes after the first of a multi-step step (SchedulerOutput.num_decode_passes), each feeding
every request the token it sampled in the pass before.

The scheduler grants them to plain greedy decodes only (Sampler.all_plain_greedy), whose sampling reads nothing the
passes change but a grammar's state. Without grammars they run, where they can:
- in the model's native loop, every pass in one call (NativeStack.greedy_passes, models/cpu/greedy.py);
- off the CPU, queued on the device one after the other: each pass's argmax stays there as the next pass's input and
  the tokens of all of them come back in one copy at the end, so the host prepares a pass while the GPU runs the one
  before instead of waiting for every pass's tokens;
and otherwise one at a time, as the runner runs its first pass. Every way gives the tokens and logprobs of the
passes run one by one: each pass's logits, reduced per row as the sampler reduces them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenriver.kv.cache import KVCache
from tokenriver.models.contract import CausalLM
from tokenriver.runner.inputs import ModelInputs, advance_decode
from tokenriver.runner.native_stack import NativeStack
from tokenriver.sampling.sampler import Sampler, SampleResult, SamplingState, torch_row_reductions
from tokenriver.sched.output import RequestStepResult

# The runner's forward pass (CUDA graph or NativeStack), counted: inputs → final-norm hidden states.
RunModel = Callable[[ModelInputs], torch.Tensor]
# Gives each row of a pass its grammar to ask lazily, after the output grown within the step.
AddGrammars = Callable[[list, list[SamplingState], list[list[int]]], None]


class GreedyPasses:
    """The runner's greedy shortcuts (module docstring); run_model is the runner's counted forward pass."""

    def __init__(
        self,
        model: CausalLM,
        forward: NativeStack,
        sampler: Sampler,
        kv_cache: KVCache,
        device: torch.device,
        run_model: RunModel,
        add_grammars: AddGrammars,
        has_graphs: bool,
    ) -> None:
        self.model = model
        self.forward = forward
        self.sampler = sampler
        self.kv_cache = kv_cache
        self.device = device
        self.run_model = run_model
        self.add_grammars = add_grammars
        # The native loop replays no CUDA graph: with graphs, the passes go the device's way.
        self.has_graphs = has_graphs
        # Queue the passes on the device: what a GPU gains, the CPU, where a pass's tokens are on the host as soon as
        # it ends, would only pay for in reductions.
        self.queue_on_device = device.type != "cpu"
        # Passes run by the native loop, which does not go through run_model (the runner adds them to its count).
        self.num_native_passes = 0

    def decode_ahead(
        self, num_passes: int, inputs: ModelInputs, states: list[SamplingState], results: dict[str, RequestStepResult]
    ) -> None:
        """num_passes more passes after the first one (`inputs`), their tokens appended to results. Every pass
        samples with the first pass's states, each constrained row asking its grammar after the grown output."""
        finished = self._native(num_passes, inputs, states, results) or self._queued(
            num_passes, inputs, states, results
        )
        if finished == num_passes:
            return
        for done in range(finished, 0, -1):  # the inputs of the last pass it ran
            sampled = [results[request.request_id].token_ids[-1 - done] for request in inputs.sampling_requests]
            inputs = advance_decode(inputs, sampled, self.kv_cache.block_size, self.device)
        for _ in range(num_passes - finished):
            requests = inputs.sampling_requests
            sampled = [results[request.request_id].token_ids[-1] for request in requests]
            inputs = advance_decode(inputs, sampled, self.kv_cache.block_size, self.device)
            hidden = self.run_model(inputs)
            if any(state.grammar is not None for state in states):
                for state in states:
                    state.allowed_token_mask = None  # a refused row's mask from the pass before
                self.add_grammars(
                    requests,
                    states,
                    [request.output_token_ids + results[request.request_id].token_ids for request in requests],
                )
            samples = self.sampler.sample(self.model.compute_logits(hidden), states)
            for request, sample in zip(requests, samples):
                append_samples(results.setdefault(request.request_id, RequestStepResult()), [sample])

    def _takes_shortcut(self, num_passes: int, states: list[SamplingState]) -> bool:
        return (
            num_passes > 0
            and not any(state.grammar is not None for state in states)
            and self.sampler.all_plain_greedy(states)
        )

    def _native(
        self, num_passes: int, inputs: ModelInputs, states: list[SamplingState], results: dict[str, RequestStepResult]
    ) -> int:
        """The passes in the model's native loop, where it has one; how many it ran (0: none)."""
        if self.has_graphs or not self._takes_shortcut(num_passes, states):
            return 0
        requests = inputs.sampling_requests
        tables = [request.block_ids for request in requests]
        width = max(len(table) for table in tables)
        block_tables = torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.long)
        reduced = self.forward.greedy_passes(
            num_passes,
            [results[request.request_id].token_ids[-1] for request in requests],
            (inputs.positions + 1).tolist(),
            block_tables,
            self.kv_cache,
        )
        if reduced is None:
            return 0
        self._append_reduced(reduced, requests, states, results)
        self.num_native_passes += reduced[0].shape[0]
        return reduced[0].shape[0]

    def _queued(
        self, num_passes: int, inputs: ModelInputs, states: list[SamplingState], results: dict[str, RequestStepResult]
    ) -> int:
        """The passes queued on the device, nothing read back in between; how many it ran (0: none)."""
        if not self.queue_on_device or not self._takes_shortcut(num_passes, states):
            return 0
        requests = inputs.sampling_requests
        token_ids: list[int] | torch.Tensor = [results[request.request_id].token_ids[-1] for request in requests]
        passes = []
        for _ in range(num_passes):
            inputs = advance_decode(inputs, token_ids, self.kv_cache.block_size, self.device)
            reduced = torch_row_reductions(self.model.compute_logits(self.run_model(inputs)))
            passes.append(reduced)
            token_ids = reduced[0]
        stacked = tuple(torch.stack(rows).cpu() for rows in zip(*passes))  # [P, B] each
        self._append_reduced(stacked, requests, states, results)
        return num_passes

    def _append_reduced(
        self,
        reduced: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        requests: list,
        states: list[SamplingState],
        results: dict[str, RequestStepResult],
    ) -> None:
        """Each pass's (argmax, largest logit, log-sum-exp) [P, B] as the samples of its rows, in pass order."""
        argmax, max_logits, log_normalizers = reduced
        for p in range(argmax.shape[0]):
            samples = self.sampler.sample_reduced((argmax[p], max_logits[p], log_normalizers[p]), states)
            for request, sample in zip(requests, samples):
                append_samples(results[request.request_id], [sample])


def append_samples(result: RequestStepResult, samples: list[SampleResult]) -> None:
    """A request's sampled tokens, their logprobs and traces, onto its step result."""
    for sample in samples:
        result.token_ids.append(sample.token_id)
        result.logprobs.append(sample.logprob)
        if sample.trace is not None:
            result.traces.append(sample.trace)
