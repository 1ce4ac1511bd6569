"""Random adds, aborts, finishes and steps against a small pool: the accounting never drifts.

Invariants after every rule: block ref counts equal the block tables that hold
them, free + used == total, a block is shared only as the same cached prefix
block, no request runs past max_num_seqs, every request's tokens so far are the
reference model's, prompt logprobs arrive once each and in order. At the end,
everything finishes and the pool is entirely free.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from sched_fake_runner import check_pool_invariants, make_request, make_setup, prompt_logprob_entry, reference_tokens

from tokenriver.outputs import FinishReason

BLOCK_SIZE = 4
NUM_BLOCKS = 16
MAX_MODEL_LEN = 48
MAX_NUM_SEQS = 4
# A few shared beginnings, so prompts hit each other's cached blocks.
PREFIXES = [[100 + i for i in range(24)], [300 + (i * 7) % 50 for i in range(24)]]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(budget=st.sampled_from([3, 8, 64]), recompute=st.booleans(), prefix_caching=st.booleans())
    def setup(self, budget, recompute, prefix_caching):
        self.scheduler, self.runner, self.driver = make_setup(
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=budget,
            max_model_len=MAX_MODEL_LEN,
            enable_prefix_caching=prefix_caching,
            recompute_every_step=recompute,
        )
        self.requests = []
        self.live_ids = []

    @rule(
        prefix=st.sampled_from(PREFIXES),
        prefix_length=st.integers(0, 24),
        suffix=st.lists(st.integers(10, 999), max_size=20),
        max_tokens=st.integers(1, 20),
        priority=st.integers(0, 2),
        prompt_logprobs=st.booleans(),
    )
    def add(self, prefix, prefix_length, suffix, max_tokens, priority, prompt_logprobs):
        prompt = prefix[:prefix_length] + suffix
        if not prompt:
            return
        request = make_request(
            f"r{len(self.requests)}",
            prompt,
            max_tokens=max_tokens,
            priority=priority,
            arrival_time=float(len(self.requests)),
            prompt_logprobs=1 if prompt_logprobs else None,
        )
        self.scheduler.add_request(request)
        self.requests.append(request)
        self.live_ids.append(request.request_id)

    @precondition(lambda self: self.live_ids)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(self.live_ids))
        assert self.scheduler.abort_request(request_id)
        self.live_ids.remove(request_id)

    @precondition(lambda self: self.live_ids)
    @rule(data=st.data())
    def finish_by_stop_string(self, data):
        request_id = data.draw(st.sampled_from(self.live_ids))
        assert self.scheduler.finish_request(request_id, FinishReason.STOP, "</s>")
        self.live_ids.remove(request_id)

    @rule(num_steps=st.integers(1, 5))
    def step(self, num_steps):
        for _ in range(num_steps):
            output, _ = self.driver.step()
            assert output.num_batched_tokens <= self.scheduler.max_num_batched_tokens
            assert len({s.request_id for s in output.scheduled}) == len(output.scheduled)
            self.live_ids = [r for r in self.live_ids if not self.scheduler.get_request(r).is_finished]

    @invariant()
    def accounting(self):
        check_pool_invariants(self.scheduler, self.requests)
        assert self.scheduler.num_running <= MAX_NUM_SEQS
        assert self.scheduler.num_running + self.scheduler.num_waiting == len(self.live_ids)

    @invariant()
    def tokens_match_the_reference(self):
        for request in self.requests:
            output = request.output_token_ids
            assert output == reference_tokens(request.prompt_token_ids, len(output))
            assert self.driver.tokens.get(request.request_id, []) == output
            logprobs = self.driver.prompt_logprobs.get(request.request_id, [])
            assert logprobs == [prompt_logprob_entry(request.prompt_token_ids, p) for p in range(len(logprobs))]

    def teardown(self):
        self.driver.run()
        check_pool_invariants(self.scheduler, self.requests)
        assert self.scheduler.block_manager.num_used_blocks == 0
        assert self.scheduler.block_manager.usage == 0.0
        for request in self.requests:
            assert request.is_finished
            if request.finish_reason is FinishReason.LENGTH:
                limit = min(request.sampling_params.max_tokens, MAX_MODEL_LEN - request.num_prompt_tokens)
                assert request.num_output_tokens == limit
            if request.sampling_params.prompt_logprobs is not None and request.output_token_ids:
                assert len(self.driver.prompt_logprobs[request.request_id]) == request.num_prompt_tokens - 1


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSchedulerStateMachine = SchedulerMachine.TestCase
