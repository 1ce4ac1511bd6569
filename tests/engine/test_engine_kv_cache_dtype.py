"""A float16 or int8 KV pool under the float32 model (kv_cache_dtype): twice (float16) or nearly four times (int8)
the tokens in the same memory, batch invariance kept, and the same tokens as the float32 pool up to the rounding of
keys and values."""

from __future__ import annotations

import pytest
import torch
from test_engine_batching import greedy_tokens, make_prompts

from tokenriver.engine.llm import LLM
from tokenriver.params import SamplingParams


def test_a_float16_pool_holds_twice_the_tokens(loaded_packed):
    wide = LLM.from_loaded(loaded_packed, kv_cache_memory="48MiB")
    narrow = LLM.from_loaded(loaded_packed, kv_cache_memory="48MiB", kv_cache_dtype="float16")
    assert narrow.engine.kv_cache.num_blocks == 2 * wide.engine.kv_cache.num_blocks
    assert narrow.engine.kv_cache.num_bytes == wide.engine.kv_cache.num_bytes
    assert narrow.engine.kv_cache.layers[0][0].dtype == torch.float16


def test_an_int8_pool_holds_nearly_four_times_the_tokens(loaded_packed):
    wide = LLM.from_loaded(loaded_packed, kv_cache_memory="48MiB")
    narrow = LLM.from_loaded(loaded_packed, kv_cache_memory="48MiB", kv_cache_dtype="int8")
    # A token's vector for one kv head: 64 float32 values (256 bytes) against 64 int8 values and a float32 scale.
    cache = narrow.engine.kv_cache
    per_block = cache.num_bytes // cache.num_blocks
    assert per_block * 256 == wide.engine.kv_cache.num_bytes // wide.engine.kv_cache.num_blocks * 68
    assert cache.num_bytes <= 48 << 20 < cache.num_bytes + per_block
    assert narrow.engine.kv_cache.layers[0][0].dtype == torch.int8


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "int8"])
def test_a_narrow_pool_keeps_batch_invariance(loaded_packed, kv_cache_dtype):
    prompts = make_prompts(loaded_packed.tokenizer, 12, 10, 150, seed=4)
    max_tokens = [6 + 3 * (i % 5) for i in range(len(prompts))]
    alone = LLM.from_loaded(
        loaded_packed, kv_cache_dtype=kv_cache_dtype, max_num_seqs=1, max_num_kv_tokens=256, enable_prefix_caching=False
    )
    batched = LLM.from_loaded(
        loaded_packed,
        kv_cache_dtype=kv_cache_dtype,
        max_num_seqs=64,
        max_num_batched_tokens=256,
        max_num_kv_tokens=1 << 14,
    )
    assert greedy_tokens(batched, prompts, max_tokens) == greedy_tokens(alone, prompts, max_tokens)


# Largest change in a greedy token's log-probability against the float32 pool, while the continuations agree.
# Measured at the time of writing over these prompts: float16 at most 0.002, int8 at most 0.12.
@pytest.mark.parametrize("kv_cache_dtype, tolerance", [("float16", 0.05), ("int8", 0.25)])
def test_a_narrow_pool_follows_the_float32_pool(loaded_packed, kv_cache_dtype, tolerance):
    """Greedy continuations agree; where they do, each token's log-probability is within the pool's rounding."""
    prompts = ["The capital of France is", "Write a haiku about rivers:", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1)
    wide = LLM.from_loaded(loaded_packed).generate(prompts, params, use_tqdm=False)
    narrow = LLM.from_loaded(loaded_packed, kv_cache_dtype=kv_cache_dtype).generate(prompts, params, use_tqdm=False)
    agreeing, largest = 0, 0.0
    for a, b in zip(wide, narrow):
        for step, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)):
            if x != y:
                break
            want, got = a.outputs[0].logprobs[step][x].logprob, b.outputs[0].logprobs[step][y].logprob
            largest = max(largest, abs(got - want))
            agreeing += 1
    print(f"{kv_cache_dtype}: {agreeing} agreeing tokens, largest log-probability change {largest:.4f}")
    assert largest <= tolerance
    assert agreeing >= 3 * 12


def test_a_bfloat16_pool_runs_on_the_torch_attention_path(loaded_packed):
    """No native kernel reads bfloat16 pools: the modules and SDPA run them, widening keys and values to float32."""
    prompt = "The capital of France is"
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
    (wide,) = LLM.from_loaded(loaded_packed).generate([prompt], params, use_tqdm=False)
    bf16 = LLM.from_loaded(loaded_packed, kv_cache_dtype="bfloat16")
    assert bf16.engine.kv_cache.layers[0][0].dtype == torch.bfloat16
    (narrow,) = bf16.generate([prompt], params, use_tqdm=False)
    first = wide.outputs[0].token_ids[0]
    assert narrow.outputs[0].token_ids[0] == first
    assert narrow.outputs[0].logprobs[0][first].logprob == pytest.approx(
        wide.outputs[0].logprobs[0][first].logprob, abs=0.1
    )
