"""A scripted stand-in for the model runner, with a simulated KV cache.

It stores each computed token id in the slot the block table gives it and, to
sample, reads the whole context back *from those slots*: a wrong block table, a
prefix-cache hit on the wrong block, or a block overwritten while shared all change
the tokens it returns. The "model" is a fixed function of the context, so the
expected output of any prompt is known without a scheduler (`reference_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable

from tokenriver.kv.block_manager import BlockManager
from tokenriver.outputs import TokenLogprobs
from tokenriver.params import SamplingParams
from tokenriver.sched.output import RequestStepResult, RunnerOutput, SchedulerOutput
from tokenriver.sched.request import Request, RequestStatus
from tokenriver.sched.scheduler import Scheduler

VOCAB_SIZE = 1000
# Token ids the default model never emits, free for tests to use as EOS / stop tokens.
RESERVED_TOKEN_IDS = range(0, 10)


def next_token(context: list[int]) -> int:
    """A deterministic 'model': depends on every token of the context and its position."""
    value = len(context)
    for position, token_id in enumerate(context):
        value = (value * 1_000_003 + token_id * (position + 7)) % 2_147_483_647
    return 10 + value % (VOCAB_SIZE - 10)


def reference_tokens(prompt: list[int], num_tokens: int, model: Callable[[list[int]], int] = next_token) -> list[int]:
    """What the model generates for prompt without any scheduler, cache or batching."""
    context = list(prompt)
    for _ in range(num_tokens):
        context.append(model(context))
    return context[len(prompt) :]


def prompt_logprob_entry(prompt: list[int], position: int) -> TokenLogprobs:
    """The fake prompt logprob of the prompt token following position."""
    return TokenLogprobs(token_id=prompt[position + 1], logprob=-float(position), rank=1)


class FakeRunner:
    """Executes SchedulerOutputs against a token-valued KV pool."""

    def __init__(self, num_blocks: int, block_size: int, model: Callable[[list[int]], int] = next_token) -> None:
        self.block_size = block_size
        self.model = model
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.num_steps = 0
        self.dropped_request_ids: list[str] = []

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.num_steps += 1
        self.dropped_request_ids.extend(scheduler_output.finished_request_ids)
        # Like the real runner: the whole step's K/V is written before anyone reads.
        for scheduled in scheduler_output.scheduled:
            start = scheduled.start_position
            known = scheduled.prompt_token_ids + scheduled.output_token_ids
            if scheduled.token_ids != known[start : start + scheduled.num_tokens]:
                raise AssertionError(f"{scheduled.request_id}: scheduled tokens are not the next known tokens")
            if len(scheduled.block_ids) < -(-(start + scheduled.num_tokens) // self.block_size):
                raise AssertionError(f"{scheduled.request_id}: block table too short")
            for offset, token_id in enumerate(scheduled.token_ids):
                self.slots[self._slot(scheduled.block_ids, start + offset)] = token_id
        results = {}
        for scheduled in scheduler_output.scheduled:
            start = scheduled.start_position
            result = RequestStepResult()
            if scheduled.sampling_params.prompt_logprobs is not None:
                end = min(start + scheduled.num_tokens, len(scheduled.prompt_token_ids) - 1)
                result.prompt_logprobs = [
                    prompt_logprob_entry(scheduled.prompt_token_ids, p) for p in range(start, end)
                ]
            if scheduled.sample:
                end = start + scheduled.num_tokens
                context = [self.slots[self._slot(scheduled.block_ids, p)] for p in range(end)]
                token_id = self.model(context)
                result.token_ids = [token_id]
                result.logprobs = [TokenLogprobs(token_id=token_id, logprob=-0.5, rank=1)]
                result.traces = [f"trace-{scheduled.request_id}-{len(scheduled.output_token_ids)}"]
            results[scheduled.request_id] = result
        # Multi-step: each further pass stores the token the pass before sampled, then samples the next one.
        for _ in range(scheduler_output.num_decode_passes - 1):
            for scheduled in scheduler_output.scheduled:
                result = results[scheduled.request_id]
                position = scheduled.start_position + len(result.token_ids)
                if len(scheduled.block_ids) <= position // self.block_size:
                    raise AssertionError(f"{scheduled.request_id}: no block for pass position {position}")
                self.slots[self._slot(scheduled.block_ids, position)] = result.token_ids[-1]
                token_id = self.model([self.slots[self._slot(scheduled.block_ids, p)] for p in range(position + 1)])
                result.token_ids.append(token_id)
                result.logprobs.append(TokenLogprobs(token_id=token_id, logprob=-0.5, rank=1))
                result.traces.append(f"trace-{scheduled.request_id}-{position}")
        return RunnerOutput(results=results)


class Driver:
    """Runs the engine's step loop (schedule → execute → update) and collects what each request got."""

    def __init__(self, scheduler: Scheduler, runner: FakeRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.tokens: dict[str, list[int]] = {}
        self.finish_reasons: dict = {}
        self.stop_reasons: dict = {}
        self.prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        self.outputs: list[SchedulerOutput] = []

    def step(self):
        scheduler_output = self.scheduler.schedule()
        self.outputs.append(scheduler_output)
        updates = self.scheduler.update(scheduler_output, self.runner.execute(scheduler_output))
        for update in updates:
            tokens = self.tokens.setdefault(update.request_id, [])
            tokens.extend(update.new_token_ids)
            if len(update.new_logprobs) != len(update.new_token_ids) or len(update.new_traces) != len(
                update.new_token_ids
            ):
                raise AssertionError("logprobs / traces not aligned with tokens")
            self.prompt_logprobs.setdefault(update.request_id, []).extend(update.prompt_logprobs)
            if update.finished:
                self.finish_reasons[update.request_id] = update.finish_reason
                self.stop_reasons[update.request_id] = update.stop_reason
        return scheduler_output, updates

    def run(self, max_steps: int = 10_000) -> int:
        """Step until every request finished; returns the number of steps."""
        for num_steps in range(1, max_steps + 1):
            self.step()
            if not self.scheduler.has_unfinished_requests():
                return num_steps
        raise AssertionError(f"requests still unfinished after {max_steps} steps")


def check_pool_invariants(scheduler: Scheduler, requests: list[Request]) -> None:
    """Block accounting agrees with the requests' block tables.

    requests: every Request the test created (finished ones hold nothing).
    """
    manager = scheduler.block_manager
    # block id → (request id, index in its block table) of every holder.
    owners: dict[int, list[tuple[str, int]]] = {}
    for request in requests:
        if request.status is not RequestStatus.RUNNING and request.block_ids:
            raise AssertionError(f"{request!r} holds blocks while not running")
        if len(set(request.block_ids)) != len(request.block_ids):
            raise AssertionError(f"{request!r} holds a block twice")
        for index, block_id in enumerate(request.block_ids):
            owners.setdefault(block_id, []).append((request.request_id, index))
    num_used = 0
    for block_id in range(manager.num_total_blocks):
        holders = owners.get(block_id, [])
        if manager.ref_count(block_id) != len(holders):
            raise AssertionError(f"block {block_id}: ref_count {manager.ref_count(block_id)}, held by {holders}")
        if len(holders) > 1 and (manager.block_hash(block_id) is None or len({i for _, i in holders}) > 1):
            raise AssertionError(f"block {block_id} shared by {holders} without being the same cached prefix block")
        num_used += bool(holders)
    if manager.num_used_blocks != num_used or manager.num_free_blocks + num_used != manager.num_total_blocks:
        raise AssertionError(
            f"used {manager.num_used_blocks} / free {manager.num_free_blocks}, "
            f"counted {num_used} held of {manager.num_total_blocks}"
        )


def make_request(
    request_id: str,
    prompt: list[int],
    *,
    max_tokens: int | None = 8,
    priority: int = 0,
    arrival_time: float = 0.0,
    eos_token_ids: tuple[int, ...] = (),
    **params,
) -> Request:
    return Request(
        request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), list(eos_token_ids), arrival_time, priority
    )


def make_setup(
    *,
    num_blocks: int = 256,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    max_model_len: int = 4096,
    enable_prefix_caching: bool = True,
    recompute_every_step: bool = False,
    model: Callable[[list[int]], int] = next_token,
    clock=None,
    num_scheduler_steps: int = 1,
):
    """A scheduler over a fresh pool, its fake runner and a driver."""
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
    extra = {} if clock is None else {"clock": clock}
    scheduler = Scheduler(
        manager,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        recompute_every_step=recompute_every_step,
        num_scheduler_steps=num_scheduler_steps,
        **extra,
    )
    runner = FakeRunner(num_blocks, block_size, model)
    return scheduler, runner, Driver(scheduler, runner)
