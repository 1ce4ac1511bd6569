"""EngineCore: the step loop. One thread, one step at a time, deterministic for fixed seeds.

    propose drafts → schedule → execute → update → beam search → process outputs

The core takes typed requests (prompt token ids + SamplingParams) and returns
RequestOutput deltas; tokenizing prompts and formatting responses happen in
the layers above. A user request with n or best_of > 1 runs as that many
engine requests ("<id>#<i>") that share the prompt's cached blocks; a beam
search runs as one engine request per live beam ("<id>#beam<j>", see
decoding/beam_groups.py). A request with PoolingParams instead of SamplingParams
embeds or scores its prompt in one step and generates nothing. With speculative decoding on, a proposer drafts
tokens for the decoding requests before each step (decoding/speculative.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass

import torch

from tokenriver.config import EngineConfig, default_num_threads
from tokenriver.decoding.beam_groups import BeamGroups
from tokenriver.decoding.speculative import Speculator, build_speculator
from tokenriver.distributed.launch import start_tensor_parallel
from tokenriver.engine.memory import MemoryAccount, memory_account
from tokenriver.engine.output_processor import OutputProcessor
from tokenriver.engine.token_cost import TokenCost, token_cost
from tokenriver.errors import DuplicateRequestIdError, InvalidParameterError, RequestNotFoundError
from tokenriver.kv.block_manager import BlockManager
from tokenriver.kv.cache import KVCache, bytes_per_block
from tokenriver.loader.load import LoadedModel, load_model
from tokenriver.outputs import FinishReason, RequestOutput
from tokenriver.params import PoolingParams, SamplingParams
from tokenriver.prompts import check_prompt
from tokenriver.runner.contract import Runner
from tokenriver.runner.model_runner import ModelRunner
from tokenriver.sampling.grammar import GrammarCompiler, GrammarMatchers
from tokenriver.sched.output import SchedulerOutput, SchedulerStats
from tokenriver.sched.request import Request
from tokenriver.sched.scheduler import Scheduler

DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3
# On a GPU the pool takes what is free after the weights, less this share of the card (at least 1 GiB) for a step's
# activations and the CUDA graphs: the pool is what lets a GPU batch, and nothing else lives there.
GPU_HEADROOM_FRACTION = 0.1


@dataclass
class StepStats:
    """What one step did, for logs, /metrics and the visualizer."""

    scheduler: SchedulerStats
    # Wall time of the step (schedule + forward + sample + detokenize), seconds.
    step_time: float
    # Forward passes of the model run since start.
    num_forward_passes: int
    # Forward passes of the speculative draft model since start (0 without one).
    num_draft_forward_passes: int = 0


@dataclass(frozen=True)
class ModelInfo:
    """The loaded model and the engine's sizes, fixed at start: what the layers above (server, CLI) may know."""

    path: str
    vocab_size: int
    max_model_len: int
    num_parameters: int
    # Bytes of the model's weights as loaded.
    num_bytes: int
    # What the weights are, for the startup log: parameters, bytes per in-memory format, the file's types.
    weights: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    num_kv_blocks: int
    kv_cache_bytes: int
    max_num_batched_tokens: int
    max_num_seqs: int
    # Engine requests allowed to wait for a batch slot (SchedulerConfig.max_waiting_requests, resolved).
    max_waiting_requests: int
    speculative_draft: str | None
    num_speculative_tokens: int
    # Tokens that end a generation (the visualizer ends a branch forced onto one, as the engine would).
    eos_token_ids: tuple[int, ...] = ()
    # Bytes of K and V one token occupies across all layers.
    kv_bytes_per_token: int = 0
    # What the model can do beyond generating: False for an encoder (it embeds and scores only), the width of
    # its embeddings, and the outputs of its classification head (0 without one; a cross-encoder has 1 or 2).
    is_causal: bool = True
    hidden_size: int = 0
    num_labels: int = 0
    # The process's resident memory by part once the engine was built (engine/memory.py), one line for the startup
    # log; empty where it cannot be read.
    memory: str = ""
    # What a token and a pass cost: parameters, multiply-adds, bytes read (engine/token_cost.py); zeros where uncounted.
    token_cost: TokenCost = TokenCost(0, 0, 0, 0, 0, 0)


@dataclass(slots=True)
class PassRow:
    """One request's share of a forward pass, as the visualizer's timeline draws it."""

    request_id: str
    # Tokens the pass computed for it: a prompt chunk, or one decode token (plus its draft tokens, if any).
    num_tokens: int
    # True while the request is still computing its prompt (prefill); False for a decode row.
    is_prompt: bool
    num_draft_tokens: int = 0
    # Positions of the request's context after the pass: the K/V its attention read, this pass's own included.
    num_context_tokens: int = 0
    # Rows the output layer computed logits for: 1 where the pass samples it (plus one per draft token), 0 for a
    # prompt chunk short of the prompt's end.
    num_logit_rows: int = 0


@dataclass(frozen=True, slots=True)
class PassLogEntry:
    """One step in the pass log: the requests its forward pass carried and how long the pass took."""

    # Forward passes of the model run since start, after this step: the pass's number.
    num_forward_passes: int
    rows: list[PassRow]
    # Wall seconds of the runner's execute: the forward pass, the output layer and the sampling of its rows.
    seconds: float
    # Forward passes the step ran: 1, or more in a multi-step step (num_scheduler_steps), timed together.
    num_passes: int = 1


# Steps the engine remembers for GET /v1/visualizer/passes: enough for a few generations, bounded memory.
PASS_LOG_LENGTH = 512


def default_kv_cache_memory(device: str) -> int:
    """The pool's bytes when none are asked for: 2 GiB on the CPU; on a GPU, its free memory after the weights less
    the headroom above (vLLM sizes its pool the same way, from gpu_memory_utilization)."""
    if torch.device(device).type != "cuda":
        return DEFAULT_KV_CACHE_MEMORY
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return max(0, free - max(int(total * GPU_HEADROOM_FRACTION), 1024**3))


def check_device(device: str) -> None:
    """Refuse a device this PyTorch cannot run on, before any weight is read."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise InvalidParameterError(
            f"device={device!r} is not a torch device: use cpu or cuda (cuda:N for the N-th GPU)", param="device"
        ) from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError(
            f"device={device!r} but this PyTorch ({torch.__version__}) sees no CUDA GPU: "
            "install a CUDA build of torch on a machine with an NVIDIA driver, or use "
            "--device cpu",
            param="device",
        )
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise InvalidParameterError(
            f"device={device!r}: this machine has {torch.cuda.device_count()} GPU(s), numbered from 0", param="device"
        )
    if parsed.type not in ("cpu", "cuda"):
        raise InvalidParameterError(f"device={device!r}: tokenriver runs on cpu or cuda", param="device")


def kv_pool_blocks(config: EngineConfig, loaded: LoadedModel, max_model_len: int) -> int:
    """Blocks in the KV pool: from kv_cache_memory, or max_num_kv_tokens, or the device's default memory
    (default_kv_cache_memory)."""
    model_config, cache, scheduler = loaded.config, config.cache, config.scheduler
    if not model_config.is_causal:
        # An encoder keeps no K/V: its blocks only give one step's tokens their slots.
        return -(-scheduler.max_num_batched_tokens // cache.block_size) + scheduler.max_num_seqs
    dtype = getattr(torch, config.resolved_kv_cache_dtype)
    per_block = bytes_per_block(
        model_config.num_layers, cache.block_size, model_config.num_kv_heads, model_config.head_dim, dtype
    )
    if cache.max_num_kv_tokens is not None:
        num_blocks = -(-cache.max_num_kv_tokens // cache.block_size)
    else:
        memory = cache.kv_cache_memory if cache.kv_cache_memory is not None else default_kv_cache_memory(config.device)
        num_blocks = memory // per_block
        if cache.kv_cache_memory is None:
            # Unasked-for memory is capped at what max_num_seqs full contexts could ever use.
            num_blocks = min(num_blocks, scheduler.max_num_seqs * -(-max_model_len // cache.block_size))
    if num_blocks < 1:
        raise InvalidParameterError(
            f"kv_cache_memory={cache.kv_cache_memory} bytes holds no KV block: one block of {cache.block_size} "
            f"tokens needs {per_block} bytes for this model; give at least that much",
            param="kv_cache_memory",
        )
    return num_blocks


class EngineCore:
    """Owns the model, the KV pool, the scheduler and the runner."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        cache, scheduler = config.cache, config.scheduler
        torch.set_num_threads(config.parallel.num_threads or default_num_threads())
        check_device(config.device)
        int8_activations = config.resolved_int8_activations
        self.loaded = (
            loaded
            if loaded is not None
            else load_model(
                config.model,
                config.resolved_dtype,
                config.device,
                config.numerics.quantization,
                int8_activations=int8_activations,
                # Tensor parallelism shards the int4/int8 layouts (loader/load.py).
                kquant_layout=False if config.parallel.tensor_parallel_size > 1 else None,
            )
        )
        if int8_activations is not None and self.loaded.int8_activations != int8_activations:
            raise InvalidParameterError(
                f"int8_activations={int8_activations} but the given model was loaded with "
                f"int8_activations={self.loaded.int8_activations}: load it with the setting the engine should use",
                param="int8_activations",
            )
        self.tokenizer = self.loaded.tokenizer
        model_config = self.loaded.config
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        if self.max_model_len > model_config.max_position_embeddings:
            raise InvalidParameterError(
                f"max_model_len={self.max_model_len} exceeds the model's context length "
                f"({model_config.max_position_embeddings}); lower it",
                param="max_model_len",
            )
        num_blocks = kv_pool_blocks(config, self.loaded, self.max_model_len)
        use_graphs = config.cuda_graphs and torch.device(config.device).type == "cuda"
        self.kv_cache = KVCache(
            model_config.num_layers,
            num_blocks,
            cache.block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            getattr(torch, config.resolved_kv_cache_dtype),
            config.device,
            padding_block=use_graphs,
        )
        use_prefix_cache = cache.enable_prefix_caching and cache.use_kv_cache
        self.block_manager = BlockManager(num_blocks, cache.block_size, enable_prefix_caching=use_prefix_cache)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=scheduler.max_num_seqs,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            recompute_every_step=not cache.use_kv_cache,
            num_scheduler_steps=scheduler.num_scheduler_steps,
        )
        # Structured output: compiled grammars, shared with the threads that submit requests (compile()).
        self.grammar = GrammarCompiler(
            self.tokenizer.to_json, model_config.vocab_size, list(self.tokenizer.eos_token_ids)
        )
        self.runner: Runner = ModelRunner(
            self.loaded.model,
            self.kv_cache,
            config.device,
            config.seed,
            GrammarMatchers(self.grammar),
            max_graph_batch=scheduler.max_num_seqs if use_graphs else 0,
            max_model_len=self.max_model_len,
        )
        if config.parallel.tensor_parallel_size > 1:
            # This process becomes rank 0: the model is sharded in place, the cache holds this rank's kv heads.
            self.kv_cache, self.runner = start_tensor_parallel(config, self.loaded, num_blocks)
        self.speculator: Speculator | None = build_speculator(config, self.loaded, num_blocks)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.beam_groups = BeamGroups(self.scheduler, self.tokenizer)
        self.last_step: StepStats | None = None
        self.model_info = self._describe(num_blocks)
        # Which requests shared each recent step's pass, and how long it took.
        self.pass_log: deque[PassLogEntry] = deque(maxlen=PASS_LOG_LENGTH)

    def _describe(self, num_blocks: int) -> ModelInfo:
        """The model and the engine's sizes once everything is built, for the layers above (ModelInfo)."""
        config, model_config = self.config, self.loaded.config
        account = self.memory_account()
        kv_bytes_per_token = self.kv_cache.num_bytes // (num_blocks * config.cache.block_size)
        return ModelInfo(
            path=self.loaded.path,
            vocab_size=model_config.vocab_size,
            max_model_len=self.max_model_len,
            num_parameters=self.loaded.num_parameters,
            num_bytes=self.loaded.num_bytes,
            weights=self.loaded.describe(),
            dtype=config.resolved_dtype,
            kv_cache_dtype=config.resolved_kv_cache_dtype,
            block_size=config.cache.block_size,
            num_kv_blocks=num_blocks,
            kv_cache_bytes=self.kv_cache.num_bytes,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_waiting_requests=config.scheduler.resolved_max_waiting_requests(num_blocks),
            speculative_draft=config.speculative.speculative_draft,
            num_speculative_tokens=config.speculative.num_speculative_tokens,
            eos_token_ids=tuple(self.tokenizer.eos_token_ids),
            kv_bytes_per_token=kv_bytes_per_token,
            is_causal=model_config.is_causal,
            hidden_size=model_config.hidden_size,
            num_labels=model_config.num_labels,
            memory="" if account is None else account.describe(),
            token_cost=token_cost(self.loaded, kv_bytes_per_token),
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        final_only: bool = False,
    ) -> None:
        """Queue a request; raises a clear error if it can never run. With final_only, step() reports it once,
        finished, instead of after every step that changed it (a pooling request always reports once)."""
        if self.output_processor.has_request(request_id):
            raise DuplicateRequestIdError(request_id)
        vocab_size = self.loaded.config.vocab_size
        is_pooling = isinstance(params, PoolingParams)
        prompt_token_ids = check_prompt(prompt_token_ids, vocab_size, self.max_model_len, is_pooling=is_pooling)
        arrival_time = time.time() if arrival_time is None else arrival_time
        if is_pooling:
            self._add_pooling_request(request_id, prompt_token_ids, params, prompt, arrival_time, priority)
            return
        if not self.loaded.config.is_causal:
            raise InvalidParameterError(
                f"this model ({self.loaded.config.architecture}) is an encoder: it embeds and scores text, it does "
                f"not generate; use embed or rerank",
                param="model",
            )
        params.validate_for_engine(vocab_size, self.config.scheduler.max_num_seqs)
        if params.structured_output is not None:
            self.grammar.compile(params.structured_output)  # a cache hit when the submitting thread compiled it
        eos_token_ids = list(self.tokenizer.eos_token_ids)
        if params.use_beam_search:
            self.beam_groups.add_request(
                request_id, list(prompt_token_ids), params, eos_token_ids, arrival_time, priority
            )
            self.output_processor.add_beam_request(request_id, prompt, list(prompt_token_ids), params)
            return
        children = []
        for index in range(params.num_generated):
            child_params = params
            if params.num_generated > 1:
                child_seed = None if params.seed is None else params.seed + index
                child_params = dataclasses.replace(params, n=1, best_of=None, seed=child_seed)
            children.append(
                Request(
                    f"{request_id}#{index}" if params.num_generated > 1 else request_id,
                    list(prompt_token_ids),
                    child_params,
                    eos_token_ids,
                    arrival_time,
                    priority,
                )
            )
        added: list[Request] = []
        try:
            for child in children:
                self.scheduler.add_request(child)
                added.append(child)
        except Exception:
            for child in added:
                self.scheduler.abort_request(child.request_id)
            raise
        self.output_processor.add_request(
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            {child.request_id: child.metrics for child in children},
            final_only,
        )

    def _add_pooling_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        prompt: str | None,
        arrival_time: float,
        priority: int,
    ) -> None:
        params = self.resolve_pooling(params)
        request = Request(
            request_id,
            prompt_token_ids,
            SamplingParams(max_tokens=1),
            [],
            arrival_time,
            priority,
            pooling_params=params,
        )
        self.scheduler.add_request(request)
        self.output_processor.add_pooling_request(request_id, prompt, prompt_token_ids, params, request.metrics)

    def resolve_pooling(self, params: PoolingParams) -> PoolingParams:
        """The params with their pooling settled (the request's, else the engine's --pooling, else the model
        file's, else the architecture's natural one), or a clear error where this model cannot do what they ask."""
        config = self.loaded.config
        params.validate_for_model(
            model_name=config.architecture,
            is_causal=config.is_causal,
            num_labels=config.num_labels,
            hidden_size=config.hidden_size,
        )
        pooling = params.pooling or self.config.pooling or config.pooling or ("last" if config.is_causal else "cls")
        return dataclasses.replace(params, pooling=pooling)

    def special_token_id(self, text: str) -> int | None:
        """The id of `text` when the vocabulary holds it as one token that grammars must name by id (a special
        token to the grammar engine, such as Llama 3's `<|python_tag|>`); None when it is text. Tool-call
        grammars ask this about their envelope markers (tool_calls.ToolCalling)."""
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(token_ids) == 1 and self.grammar.is_special_token(token_ids[0]):
            return token_ids[0]
        return None

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free everything it holds."""
        if self.beam_groups.has_request(request_id):
            self.beam_groups.abort(request_id)
            self.output_processor.remove_request(request_id)
            return
        child_ids = self.output_processor.remove_request(request_id)
        if not child_ids:
            raise RequestNotFoundError(f"no running request has id {request_id!r}", param="request_id")
        for child_id in child_ids:
            self.scheduler.abort_request(child_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_request(self, request_id: str) -> bool:
        """Whether a request of this id is still running (added, not finished or aborted)."""
        return self.output_processor.has_request(request_id) or self.beam_groups.has_request(request_id)

    def num_waiting_requests(self) -> int:
        """Engine requests waiting for a batch slot or KV blocks (n > 1 counts n)."""
        return self.scheduler.stats().num_waiting

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix; False (nothing changes) while a request is running."""
        return self.block_manager.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        """Run one forward pass for the current batch; return the outputs that changed."""
        started = time.perf_counter()
        draft_probs = self.speculator.propose(self.scheduler) if self.speculator is not None else {}
        scheduler_output = self.scheduler.schedule()
        num_passes_before, pass_started = self.runner.num_forward_passes, time.perf_counter()
        runner_output = self.runner.execute(scheduler_output, draft_probs)
        self._log_pass(scheduler_output, num_passes_before, time.perf_counter() - pass_started)
        updates = self.scheduler.update(scheduler_output, runner_output)
        updates, beam_results = self.beam_groups.process(updates)
        outputs, stopped = self.output_processor.process(updates)
        for request_id, stop in stopped:
            self.scheduler.finish_request(request_id, FinishReason.STOP, stop)
        outputs += [
            self.output_processor.beam_output(r.request_id, r.hypotheses, r.metrics, r.steps) for r in beam_results
        ]
        if self.speculator is not None:
            self.speculator.drop_finished(self.scheduler)
        self.last_step = StepStats(
            self.scheduler.stats(),
            time.perf_counter() - started,
            self.runner.num_forward_passes,
            self._num_draft_forward_passes(),
        )
        return outputs

    def _log_pass(self, scheduler_output: SchedulerOutput, num_passes_before: int, seconds: float) -> None:
        """Append the step's pass to the pass log: each request's share, and the pass's wall time."""
        if scheduler_output.is_empty:
            return
        rows = [
            PassRow(
                r.request_id,
                len(r.token_ids),
                r.start_position < len(r.prompt_token_ids),
                len(r.draft_token_ids),
                num_context_tokens=r.start_position + r.num_scheduled_tokens,
                num_logit_rows=1 + len(r.draft_token_ids) if r.sample and r.pooling_params is None else 0,
            )
            for r in scheduler_output.scheduled
        ]
        num_forward_passes = self.runner.num_forward_passes
        self.pass_log.append(PassLogEntry(num_forward_passes, rows, seconds, num_forward_passes - num_passes_before))

    def memory_account(self) -> MemoryAccount | None:
        """The process's resident memory by part now (engine/memory.py); None where it cannot be read."""
        return memory_account(self.loaded, [tensor for pair in self.kv_cache.layers for tensor in pair])

    def close(self) -> None:
        """Release what outlives a garbage collection: the other ranks of a tensor-parallel engine, the runner's
        threads."""
        self.runner.close()

    def _num_draft_forward_passes(self) -> int:
        return self.speculator.proposer.num_forward_passes if self.speculator is not None else 0
