"""ModelRunner: one forward pass for every scheduled request, then sampling.

Owns the KV tensors and the per-request random generators (a seeded request
keeps its own stream across steps and preemptions; the generator is dropped
when the scheduler reports the request gone). Knows nothing about text.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenriver.kv.cache import KVCache
from tokenriver.runner.inputs import ModelInputs, prepare_inputs
from tokenriver.sampling.sampler import Sampler, SamplingState
from tokenriver.sched.output import RequestStepResult, RunnerOutput, ScheduledRequest, SchedulerOutput


class ModelRunner:
    """Turns a SchedulerOutput into sampled tokens."""

    def __init__(self, model: nn.Module, kv_cache: KVCache, device: torch.device | str, seed: int = 0) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        default_generator = torch.Generator(device=self.device)
        default_generator.manual_seed(seed)
        self.sampler = Sampler(default_generator)
        self._generators: dict[str, torch.Generator] = {}
        # Forward passes run so far (the visualizer's "one pass per token").
        self.num_forward_passes = 0

    def _generator_for(self, request: ScheduledRequest) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._generators[request.request_id] = generator
        return generator

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Forward all scheduled tokens in one pass, sample the requests that reached their last token."""
        for request_id in scheduler_output.finished_request_ids:
            self._generators.pop(request_id, None)
        if scheduler_output.block_copies:
            sources, destinations = zip(*scheduler_output.block_copies)
            self.kv_cache.copy_blocks(list(sources), list(destinations))
        if scheduler_output.is_empty:
            return RunnerOutput()
        inputs = prepare_inputs(scheduler_output, self.kv_cache.block_size, self.device)
        # [num_tokens, hidden_size]
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.metadata)
        self.num_forward_passes += 1
        results: dict[str, RequestStepResult] = {}
        self._score_prompts(inputs, hidden, results)
        if inputs.sample_rows:
            rows = torch.tensor(inputs.sample_rows, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))  # [num_sampling, vocab] float32
            states = [
                SamplingState(
                    params=request.sampling_params,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                    generator=self._generator_for(request),
                    eos_token_ids=request.eos_token_ids,
                )
                for request in inputs.sampling_requests
            ]
            for request, sample in zip(inputs.sampling_requests, self.sampler.sample(logits, states)):
                result = results.setdefault(request.request_id, RequestStepResult())
                result.token_ids.append(sample.token_id)
                result.logprobs.append(sample.logprob)
                if sample.trace is not None:
                    result.traces.append(sample.trace)
        return RunnerOutput(results=results)

    def _score_prompts(self, inputs: ModelInputs, hidden: torch.Tensor, results: dict[str, RequestStepResult]) -> None:
        """Log-probabilities of the actual prompt tokens, for requests that asked for prompt_logprobs."""
        for entry in inputs.prompt_logprob_rows:
            rows = torch.tensor(entry.rows, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))  # [num_rows, vocab]
            scored = self.sampler.prompt_logprobs(logits, entry.next_token_ids, entry.num_top)
            results.setdefault(entry.request_id, RequestStepResult()).prompt_logprobs.extend(scored)
