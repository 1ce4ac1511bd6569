"""ModelRunner: one forward pass for every scheduled request, then sampling.

Owns the KV tensors and the per-request random generators (a seeded request
keeps its own stream across steps and preemptions; the generator is dropped
when the scheduler reports the request gone). Knows nothing about text.

A request with draft tokens (speculative decoding) gets the logits of its last
known token and of its drafts from the same forward pass, and the sampler's
`verify` decides which drafts stand. The draft distributions a draft model
proposed from come in with the step (`draft_probs`); n-gram drafts have none.
A beam-search request gets its most likely next tokens instead of a sample.
The model runs through NativeStack (runner/native_stack.py), which hands its decoder
layers to the native decoder where they can run there; on a GPU a batch of one-token decodes
replays a recorded CUDA graph of the same pass instead (runner/cuda_graphs.py).
A multi-step step's further passes (SchedulerOutput.num_decode_passes > 1, plain greedy
decodes only), each feeding every request the token it just sampled, run in
runner/greedy_passes.py.
A request with structured output gets its grammar's allowed-token mask with every
row the sampler sees (sampling/grammar.py); its drafts are cut at the first token the
grammar rejects, and beam candidates are ranked among the allowed tokens only. The
masks of a step's sampled rows are computed on a worker thread while the forward pass
runs (both release the GIL): they depend only on the tokens known before the pass. A
plain greedy batch computes no masks: each constrained row checks its argmax against its
grammar, and only a row whose grammar refuses it gets its logits and its mask. Such a
request takes the logits-free greedy path and multi-step passes like any other.
A pooling request (an embedding or a score) samples nothing: its whole prompt's final hidden states are pooled
(runner/pooling.py).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tokenriver.kv.cache import KVCache
from tokenriver.models.attention_metadata import to_device
from tokenriver.models.contract import CausalLM, PoolingModel
from tokenriver.models.fast_path import fast_path_for
from tokenriver.runner.cuda_graphs import DecodeGraphs
from tokenriver.runner.greedy_passes import GreedyPasses, append_samples
from tokenriver.runner.inputs import ModelInputs, prepare_inputs
from tokenriver.runner.native_stack import NativeStack
from tokenriver.runner.pooling import pool
from tokenriver.sampling.grammar import GrammarMatchers, GrammarRow
from tokenriver.sampling.sampler import DraftCheck, Sampler, SamplingState, torch_row_reductions
from tokenriver.sched.output import RequestStepResult, RunnerOutput, ScheduledRequest, SchedulerOutput


class ModelRunner:
    """Turns a SchedulerOutput into sampled tokens (the runner/contract.py Runner of one process)."""

    def __init__(
        self,
        model: CausalLM | PoolingModel,
        kv_cache: KVCache,
        device: torch.device | str,
        seed: int = 0,
        grammar: GrammarMatchers | None = None,
        max_graph_batch: int = 0,
        max_model_len: int = 0,
    ) -> None:
        """max_graph_batch > 0 (a CUDA device and a pool with a padding block): decode batches up to that size
        replay CUDA graphs (runner/cuda_graphs.py) recorded for contexts up to max_model_len."""
        self.model = model
        # Calls like the model; runs its layers in one native call where it can.
        self.forward = NativeStack(model)
        self.graphs = (
            DecodeGraphs(self.forward, model, kv_cache, max_graph_batch, max_model_len) if max_graph_batch > 0 else None
        )
        # The matchers of requests with structured output; None = such requests are refused before they get here.
        self.grammar = grammar
        self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="tokenriver-grammar") if grammar else None
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        default_generator = torch.Generator(device=self.device)
        default_generator.manual_seed(seed)
        fast = fast_path_for(self.device)
        self.sampler = Sampler(default_generator, (fast and fast.row_reductions()) or torch_row_reductions)
        self._generators: dict[str, torch.Generator] = {}
        self._num_model_passes = 0
        self.greedy = GreedyPasses(
            model,
            self.forward,
            self.sampler,
            kv_cache,
            self.device,
            self._run_model,
            lambda requests, states, outputs: self._add_grammars(requests, states, None, outputs),
            has_graphs=self.graphs is not None,
        )

    @property
    def num_forward_passes(self) -> int:
        """Forward passes run so far (the visualizer's "one pass per token")."""
        return self._num_model_passes + self.greedy.num_native_passes

    def close(self) -> None:
        """Stop the grammar masks' worker thread now rather than when the runner is collected. Idempotent."""
        if self._mask_worker is not None:
            self._mask_worker.shutdown()

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

    def _state(self, request: ScheduledRequest, allowed_token_mask: torch.Tensor | None = None) -> SamplingState:
        return SamplingState(
            params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            generator=self._generator_for(request),
            eos_token_ids=request.eos_token_ids,
            allowed_token_mask=allowed_token_mask,
        )

    def _start_masks(self, requests: list[ScheduledRequest], states: list[SamplingState]) -> Future | None:
        """Begin computing the requests' allowed-token masks on the worker thread; None when no request has a
        grammar, or when the batch is plain greedy: its rows ask their grammars lazily (`_add_grammars`). The
        result is one mask or None per request."""
        if (
            self._mask_worker is None
            or all(r.sampling_params.structured_output is None for r in requests)
            or self.sampler.all_plain_greedy(states)
        ):
            return None
        return self._mask_worker.submit(lambda: [self._allowed_token_mask(request) for request in requests])

    def _add_grammars(
        self,
        requests: list[ScheduledRequest],
        states: list[SamplingState],
        pending_masks: Future | None,
        outputs: list[list[int]] | None = None,
    ) -> None:
        """Give each constrained row its mask (computed during the pass), or else its grammar to ask lazily.
        outputs: each request's output so far where it grew within this step (multi-step passes)."""
        if pending_masks is not None:
            for state, mask in zip(states, pending_masks.result()):
                state.allowed_token_mask = mask
            return
        for index, (request, state) in enumerate(zip(requests, states)):
            spec = request.sampling_params.structured_output
            if spec is not None and self.grammar is not None:
                output = outputs[index] if outputs is not None else request.output_token_ids
                state.grammar = GrammarRow(self.grammar, request.request_id, spec, output)

    def _allowed_token_mask(self, request: ScheduledRequest) -> torch.Tensor | None:
        """[W] int32: what the request's grammar allows after its output so far (None without one)."""
        spec = request.sampling_params.structured_output
        if spec is None or self.grammar is None:
            return None
        return self.grammar.mask(request.request_id, spec, request.output_token_ids)

    def _draft_check(self, request: ScheduledRequest, draft_probs: torch.Tensor | None) -> DraftCheck:
        """The request's drafts to verify, cut before the first one its grammar rejects."""
        spec = request.sampling_params.structured_output
        state = self._state(request)
        if spec is None or self.grammar is None:
            return DraftCheck(state, request.draft_token_ids, draft_probs)
        num_valid, masks = self.grammar.masks_along(
            request.request_id, spec, request.output_token_ids, request.draft_token_ids
        )
        return DraftCheck(
            state,
            request.draft_token_ids[:num_valid],
            draft_probs[:num_valid] if draft_probs is not None else None,
            masks,
        )

    @torch.inference_mode()
    def execute(
        self, scheduler_output: SchedulerOutput, draft_probs: dict[str, torch.Tensor] | None = None
    ) -> RunnerOutput:
        """Forward all scheduled tokens in one pass, sample the requests that reached their last token.

        draft_probs: request id → [num_drafts, vocab] distributions its draft tokens were drawn from (draft
        models only; a request without an entry has deterministic drafts).
        """
        for request_id in scheduler_output.finished_request_ids:
            self._generators.pop(request_id, None)
            if self.grammar is not None:
                self.grammar.drop(request_id)
        if scheduler_output.block_copies:
            sources, destinations = zip(*scheduler_output.block_copies)
            self.kv_cache.copy_blocks(list(sources), list(destinations))
        if scheduler_output.is_empty:
            return RunnerOutput()
        inputs = prepare_inputs(scheduler_output, self.kv_cache.block_size, self.device)
        states = [self._state(request) for request in inputs.sampling_requests]
        results: dict[str, RequestStepResult] = {}
        # [num_sample_rows + num_draft_rows + num_beam_rows, vocab] float32, in that order
        logits = self._run_pass(inputs, states, results)
        if logits is None:
            return RunnerOutput(results=results)
        num_sample_rows = len(inputs.sample_rows)
        num_scored_rows = num_sample_rows + sum(len(rows) for rows in inputs.draft_rows)
        if inputs.beam_requests:
            self._rank_beams(inputs.beam_requests, logits[num_scored_rows:], results)
        if inputs.sampling_requests:
            self._sample(inputs.sampling_requests, logits[:num_sample_rows], states, results)
        if inputs.draft_requests:
            draft_logits = logits[num_sample_rows:num_scored_rows]
            self._verify_drafts(inputs.draft_requests, draft_logits, draft_probs or {}, results)
        self.greedy.decode_ahead(scheduler_output.num_decode_passes - 1, inputs, states, results)
        return RunnerOutput(results=results)

    def _run_pass(
        self, inputs: ModelInputs, states: list[SamplingState], results: dict[str, RequestStepResult]
    ) -> torch.Tensor | None:
        """The step's one forward pass: pooled and prompt-scored rows are answered from its hidden states here, and
        the logits of the rows that pick a token come back (None when no row does)."""
        pending_masks = self._start_masks(inputs.sampling_requests, states)
        hidden = self._run_model(inputs)  # [num_tokens, hidden_size]
        for request, (first, num_rows) in zip(inputs.pooling_requests, inputs.pooling_rows):
            pooled = pool(self.model, hidden[first : first + num_rows], request.pooling_params)
            results[request.request_id] = RequestStepResult(pooled=pooled)
        self._score_prompts(inputs, hidden, results)
        draft_rows = [row for rows in inputs.draft_rows for row in rows]
        all_rows = inputs.sample_rows + draft_rows + inputs.beam_rows
        if not all_rows:
            return None
        if all_rows != list(range(hidden.shape[0])):  # a decode step samples every row, in order: no copy
            hidden = hidden.index_select(0, to_device(all_rows, self.device))
        self._add_grammars(inputs.sampling_requests, states, pending_masks)
        return self.model.compute_logits(hidden)  # [num_sample_rows + num_draft_rows + num_beam_rows, vocab]

    def _rank_beams(
        self, requests: list[ScheduledRequest], logits: torch.Tensor, results: dict[str, RequestStepResult]
    ) -> None:
        """Each beam row's best next tokens, for the beam search to extend its beams with (logits: [n, vocab])."""
        tops = self.sampler.top_logprobs(
            logits,
            [request.num_beam_candidates for request in requests],
            [self._allowed_token_mask(request) for request in requests],
        )
        for request, candidates in zip(requests, tops):
            results.setdefault(request.request_id, RequestStepResult()).beam_candidates = candidates

    def _sample(
        self,
        requests: list[ScheduledRequest],
        logits: torch.Tensor,
        states: list[SamplingState],
        results: dict[str, RequestStepResult],
    ) -> None:
        """One token for each request that reached its last scheduled token (logits: [n, vocab], one row each)."""
        samples = self.sampler.sample(logits, states)
        for request, sample in zip(requests, samples):
            append_samples(results.setdefault(request.request_id, RequestStepResult()), [sample])

    def _verify_drafts(
        self,
        requests: list[ScheduledRequest],
        logits: torch.Tensor,
        draft_probs: dict[str, torch.Tensor],
        results: dict[str, RequestStepResult],
    ) -> None:
        """Accept or reject each request's draft tokens against the target model's rows for them.

        logits: [num_draft_rows, vocab], per request its last known token's row then one per draft.
        """
        checks = [self._draft_check(request, draft_probs.get(request.request_id)) for request in requests]
        # Each check's rows: its last known token and the drafts it kept (a cut check skips the rest).
        kept_rows: list[int] = []
        first = 0
        for request, check in zip(requests, checks):
            kept_rows += range(first, first + len(check.draft_token_ids) + 1)
            first += len(request.draft_token_ids) + 1
        is_cut = len(kept_rows) != logits.shape[0]
        verdicts = self.sampler.verify(logits[kept_rows] if is_cut else logits, checks)
        for request, verdict in zip(requests, verdicts):
            append_samples(results.setdefault(request.request_id, RequestStepResult()), verdict.samples)

    def _run_model(self, inputs: ModelInputs) -> torch.Tensor:
        """One forward pass: replayed from a CUDA graph where one applies, else run by NativeStack."""
        self._num_model_passes += 1
        hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.metadata) if self.graphs else None
        if hidden is None:
            hidden = self.forward(inputs.input_ids, inputs.positions, self.kv_cache, inputs.metadata)
        return hidden

    def _score_prompts(self, inputs: ModelInputs, hidden: torch.Tensor, results: dict[str, RequestStepResult]) -> None:
        """Log-probabilities of the actual prompt tokens, for requests that asked for prompt_logprobs."""
        for entry in inputs.prompt_logprob_rows:
            rows = torch.tensor(entry.rows, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))  # [num_rows, vocab]
            scored = self.sampler.prompt_logprobs(logits, entry.next_token_ids, entry.num_top)
            results.setdefault(entry.request_id, RequestStepResult()).prompt_logprobs.extend(scored)
