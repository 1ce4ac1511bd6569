"""AsyncEngine: the engine core on a background thread, one async stream per request.

The core stays single-threaded and synchronous; this class only moves typed
commands in (add, abort) through a thread-safe queue and RequestOutputs out
to each caller's asyncio queue. A consumer that stops iterating (a client
that disconnected) aborts its request, which frees its KV blocks at the next
step. An exception inside a step kills the engine: every stream gets an
EngineDeadError instead of hanging.

What other threads may read: `model_info` (fixed at start) and `snapshot()`,
which the engine thread publishes after every pass of its loop (one reference
swap, so a reader never sees a half-updated scheduler). `machine_rates()`
measures the machine once, on the engine thread between two steps, and keeps
the result (`tokenriver serve` asks for it at start). A request that finds
max_waiting_requests engine requests already waiting is refused with
EngineOverloadedError.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import torch

from tokenriver.config import EngineConfig
from tokenriver.engine.core import EngineCore, ModelInfo, PassLogEntry
from tokenriver.engine.inspection import CachedPrefix, cached_prefix, inspect_position
from tokenriver.engine.machine_rates import MachineRates, measure_machine_rates
from tokenriver.errors import EngineDeadError, EngineOverloadedError
from tokenriver.loader.load import LoadedModel
from tokenriver.models.fast_path import release_thread_pool
from tokenriver.outputs import RequestOutput
from tokenriver.params import PoolingParams, SamplingParams, StructuredOutput
from tokenriver.sched.output import SchedulerStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after one pass of its loop: the scheduler's and KV pool's counts, and passes so far."""

    scheduler: SchedulerStats
    # Forward passes of the model since start.
    num_forward_passes: int


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    prompt: str | None
    priority: int
    stream: "_Stream"


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Inspect:
    token_ids: list[int]
    position: int
    top_k: int
    result: concurrent.futures.Future


@dataclass
class _Measure:
    result: concurrent.futures.Future


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """Thread-backed engine for asyncio servers."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """Build the engine core on the engine thread (load errors are raised here) and start its loop.

        Why on that thread: OpenMP keeps a pool of worker threads per thread that starts parallel work, and libgomp
        lets its workers spin between parallel regions only while it manages no more threads than there are cores.
        A load on this thread and steps on another made two pools, and every parallel region of a step then woke
        its workers from sleep: single-stream decode ran at less than half the speed of the same engine stepped on
        the thread that loaded it. A model loaded before (`loaded`) left this thread's pool behind: it is ended here,
        and this thread's next parallel work starts a new one.
        """
        if loaded is not None:
            release_thread_pool()
        self._commands: queue.Queue[_Add | _Abort | _Inspect | _Measure | None] = queue.Queue()
        self._machine_rates: concurrent.futures.Future | None = None
        self._machine_rates_lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._stopping = False
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(config, loaded), name="tokenriver-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    def snapshot(self) -> EngineSnapshot:
        """The engine's state as of its loop's last pass (never mutated after publication)."""
        return self._snapshot

    def _take_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(self.core.scheduler.stats(), self.core.runner.num_forward_passes)

    def recent_passes(self, since: int) -> list[PassLogEntry]:
        """The engine's logged steps whose forward-pass counter is above `since`, oldest first: which requests
        shared each pass and how long it took (the visualizer's timeline and roofline). Safe from any thread: the
        log is copied, again if the engine thread appended meanwhile."""
        for _ in range(3):
            try:
                entries = list(self.core.pass_log)
                break
            except RuntimeError:
                continue
        else:
            entries = []
        return [entry for entry in entries if entry.num_forward_passes > since]

    def machine_rates(self) -> concurrent.futures.Future[MachineRates]:
        """The machine's read bandwidth and arithmetic rate (engine/machine_rates.py). Measured once, on the engine
        thread between two steps so that no pass competes with it and it runs on the engine's threads; the first
        call queues the measurement and every call shares its result."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self._dead!r}")
        with self._machine_rates_lock:
            if self._machine_rates is None:
                self._machine_rates = concurrent.futures.Future()
                self._commands.put(_Measure(self._machine_rates))
            return self._machine_rates

    def check_structured_output(self, spec: StructuredOutput) -> None:
        """Compile a constraint's grammar in the calling thread (cached for the engine thread); raises
        InvalidParameterError naming the problem when it cannot be enforced."""
        self.core.grammar.compile(spec)

    def special_token_id(self, text: str) -> int | None:
        """EngineCore.special_token_id, safe from any thread (the tokenizer and the grammar compiler are)."""
        return self.core.special_token_id(text)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raises the engine's validation error if it cannot run."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self._dead!r}")
        if isinstance(params, SamplingParams) and params.structured_output is not None:
            self.check_structured_output(params.structured_output)  # here, not on the engine thread
        request_id = request_id or self.new_request_id()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._commands.put(_Add(request_id, list(prompt_token_ids), params, prompt, priority, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def pool(
        self, prompt_token_ids: list[int], params: PoolingParams, request_id: str | None = None, priority: int = 0
    ) -> RequestOutput:
        """Embed or score one input (its output's `embedding` or `score`); cancelling it aborts the request."""
        async with aclosing(self.generate(prompt_token_ids, params, request_id, priority=priority)) as outputs:
            async for output in outputs:
                if output.finished:
                    return output
        raise EngineDeadError("the engine stopped before the request finished")

    async def inspect(self, token_ids: list[int], position: int, top_k: int = 5) -> dict:
        """engine/inspection.py's per-layer view of one position, run on the engine thread between two steps (the
        model's layers over a KV cache of its own in the pool's dtype; the engine's requests and cache are
        untouched)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self._dead!r}")
        result: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Inspect(list(token_ids), position, top_k, result))
        return await asyncio.wrap_future(result)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished)."""
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the loop after the current step; requests still running get EngineDeadError."""
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout)

    def _inspection_prefix(self, token_ids: list[int]) -> CachedPrefix | None:
        """What the prefix cache holds of the tokens before an inspected position (engine/inspection.py starts
        after it), or None: nothing, or a pool this process holds only a shard of (tensor parallelism)."""
        if self.core.config.parallel.tensor_parallel_size > 1:
            return None
        return cached_prefix(self.core.block_manager, self.core.kv_cache, token_ids)

    def _handle(self, command: _Add | _Abort | _Inspect | _Measure) -> None:
        if isinstance(command, _Measure):
            try:
                command.result.set_result(measure_machine_rates(self.core.config.device))
            except Exception as error:  # a failed measurement goes back to whoever asks; the engine runs on
                command.result.set_exception(error)
            return
        if isinstance(command, _Inspect):
            try:
                command.result.set_result(
                    inspect_position(
                        self.core.loaded,
                        command.token_ids,
                        command.position,
                        command.top_k,
                        kv_dtype=getattr(torch, self.core.config.resolved_kv_cache_dtype),
                        prefix=self._inspection_prefix(command.token_ids[: command.position]),
                    )
                )
            except Exception as error:  # a refused inspection goes back to its caller; the engine runs on
                command.result.set_exception(error)
            return
        if isinstance(command, _Abort):
            if self._streams.pop(command.request_id, None) is not None:
                self.core.abort_request(command.request_id)
            return
        limit = self.model_info.max_waiting_requests
        if self.core.num_waiting_requests() >= limit:
            command.stream.put(
                EngineOverloadedError(
                    f"{limit} requests are already waiting (max_waiting_requests); retry once running requests finish"
                )
            )
            return
        try:
            self.core.add_request(
                command.request_id,
                command.prompt_token_ids,
                command.params,
                prompt=command.prompt,
                priority=command.priority,
            )
        except Exception as error:  # validation errors go back to the caller that sent the request
            command.stream.put(error)
            return
        self._streams[command.request_id] = command.stream

    def _run(self, config: EngineConfig, loaded: LoadedModel | None) -> None:
        try:
            self.core = EngineCore(config, loaded)
            self.tokenizer = self.core.tokenizer
            self.model_info: ModelInfo = self.core.model_info
            self._snapshot = self._take_snapshot()
        except BaseException as error:  # raised by __init__, in the caller's thread
            self._build_error = error
            return
        finally:
            self._built.set()
        worked = False  # since this thread's OpenMP workers last went
        try:
            while not self._stopping:
                idle = not self.core.has_unfinished_requests()
                try:
                    command = self._commands.get(timeout=0.5) if idle else self._commands.get_nowait()
                except queue.Empty:
                    command = None
                    if idle and worked:
                        # Half a second with nothing to do: the workers go (release_thread_pool), so that parallel
                        # work on other threads of this process runs at full speed; the next step starts new ones.
                        release_thread_pool()
                        worked = False
                worked = worked or command is not None
                while command is not None:
                    self._handle(command)
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        command = None
                if self._stopping or not self.core.has_unfinished_requests():
                    self._snapshot = self._take_snapshot()
                    continue
                outputs = self.core.step()
                worked = True
                # Published before the outputs go out: a client that sees its request finish sees its blocks freed.
                self._snapshot = self._take_snapshot()
                for output in outputs:
                    stream = self._streams.get(output.request_id)
                    if stream is None:
                        continue
                    if output.finished:
                        del self._streams[output.request_id]
                    stream.put(output)
        except BaseException as error:
            logger.exception("engine loop failed")
            self._dead = error
        finally:
            reason = EngineDeadError(f"the engine stopped: {self._dead!r}" if self._dead else "the engine shut down")
            for stream in self._streams.values():
                stream.put(reason)
            self._streams.clear()
