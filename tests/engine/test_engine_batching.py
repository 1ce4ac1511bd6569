"""The serving engine end to end: batch invariance, preemption, prefix caching, aborts."""

from __future__ import annotations

import random

import pytest

from tokenriver.engine.llm import LLM
from tokenriver.params import SamplingParams

WORDS = (
    "river token model cache block batch prompt stream engine layer attention sample greedy step "
    "paris ocean forest mountain city light night code python data"
).split()


def make_prompts(tokenizer, count: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        length = rng.randint(min_len, max_len)
        ids = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(length)))
        prompts.append(ids[:length])
    return prompts


def greedy_tokens(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def check_batch_invariance(loaded, count: int, min_len: int, max_len: int, small_pool_tokens: int) -> None:
    tokenizer = loaded.tokenizer
    prompts = make_prompts(tokenizer, count, min_len, max_len)
    rng = random.Random(1)
    max_tokens = [rng.randint(4, 24) for _ in prompts]
    alone_llm = LLM.from_loaded(loaded, max_num_seqs=1, max_num_kv_tokens=max_len + 64, enable_prefix_caching=False)
    alone = greedy_tokens(alone_llm, prompts, max_tokens)
    batched_llm = LLM.from_loaded(loaded, max_num_seqs=64, max_num_batched_tokens=512, max_num_kv_tokens=1 << 16)
    assert greedy_tokens(batched_llm, prompts, max_tokens) == alone
    pressured = LLM.from_loaded(
        loaded, max_num_seqs=64, max_num_batched_tokens=512, max_num_kv_tokens=small_pool_tokens
    )
    assert greedy_tokens(pressured, prompts, max_tokens) == alone
    stats = pressured.engine.scheduler.stats()
    assert stats.num_preempted_total > 0
    assert stats.num_blocks_used == 0


def test_batch_invariance_with_chunked_prefill_and_preemption(loaded_float32):
    check_batch_invariance(loaded_float32, count=16, min_len=10, max_len=200, small_pool_tokens=960)


@pytest.mark.slow
def test_batch_invariance_64_requests_up_to_1500_tokens(loaded_float32):
    check_batch_invariance(loaded_float32, count=64, min_len=10, max_len=1500, small_pool_tokens=2048)


def test_prefix_cache_hits_on_shared_prompt(loaded_float32):
    llm = LLM.from_loaded(loaded_float32, max_num_kv_tokens=8192)
    system = "You are a careful assistant who answers in one sentence. " * 8
    params = SamplingParams(max_tokens=4, temperature=0.0)
    (first,) = llm.generate([system + "What is a river?"], params, use_tqdm=False)
    (second,) = llm.generate([system + "What is a token?"], params, use_tqdm=False)
    assert first.num_cached_tokens == 0
    shared = len(llm.get_tokenizer().encode(system))
    assert second.num_cached_tokens >= (shared // 16 - 1) * 16 > 0
    uncached = LLM.from_loaded(loaded_float32, max_num_kv_tokens=8192, enable_prefix_caching=False)
    (reference,) = uncached.generate([system + "What is a token?"], params, use_tqdm=False)
    assert second.outputs[0].token_ids == reference.outputs[0].token_ids
    assert llm.reset_prefix_cache()
    (recomputed,) = llm.generate([system + "What is a token?"], params, use_tqdm=False)
    assert recomputed.num_cached_tokens == 0
    assert recomputed.outputs[0].token_ids == reference.outputs[0].token_ids


def test_abort_mid_generation_frees_every_block(loaded_float32):
    llm = LLM.from_loaded(loaded_float32, max_num_kv_tokens=4096)
    engine = llm.engine
    engine.add_request(
        "a", llm.get_tokenizer().encode("Tell me a long story."), SamplingParams(max_tokens=200, ignore_eos=True)
    )
    for _ in range(5):
        engine.step()
    assert engine.scheduler.stats().num_blocks_used > 0
    engine.abort_request("a")
    engine.step()
    assert engine.scheduler.stats().num_blocks_used == 0
    assert not engine.has_unfinished_requests()


def test_random_aborts_leave_the_pool_free(loaded_float32):
    llm = LLM.from_loaded(loaded_float32, max_num_kv_tokens=4096, max_num_seqs=32)
    engine = llm.engine
    rng = random.Random(0)
    prompts = make_prompts(llm.get_tokenizer(), 200, 5, 60, seed=2)
    live: list[str] = []
    for index, prompt in enumerate(prompts):
        request_id = f"r{index}"
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True))
        live.append(request_id)
        if rng.random() < 0.5:
            engine.step()
        if live and rng.random() < 0.7:
            victim = live.pop(rng.randrange(len(live)))
            if engine.output_processor.has_request(victim):
                engine.abort_request(victim)
    for request_id in live:
        if engine.output_processor.has_request(request_id):
            engine.abort_request(request_id)
    engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.stats().num_blocks_used == 0


def test_final_only_request_is_reported_once_finished(loaded_float32):
    llm = LLM.from_loaded(loaded_float32, max_num_kv_tokens=4096)
    engine = llm.engine
    ids = llm.get_tokenizer().encode("Name three rivers.")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("streamed", ids, params)
    engine.add_request("final", ids, params, final_only=True)
    reports: dict[str, list] = {"streamed": [], "final": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            reports[output.request_id].append(output)
    assert len(reports["streamed"]) == 12
    (final,) = reports["final"]
    assert final.finished
    assert final.outputs[0].token_ids == reports["streamed"][-1].outputs[0].token_ids
    assert final.outputs[0].text == reports["streamed"][-1].outputs[0].text
    assert not engine.output_processor.has_request("final")
