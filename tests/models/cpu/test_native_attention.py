"""The native paged attention kernel (models/cpu/csrc/attention.cpp) against the PyTorch path of attention.py.

`paged_attention` (native for float32 and float16 CPU caches) must equal `paged_attention_torch` (gather + SDPA)
within float32 rounding on ragged batches: decodes and the shortest chunks (the per-token kernel), longer chunks
(the kernel's chunk path: whole prompts, chunks after a cached prefix, several blocks of query tokens), contexts
ending exactly on block boundaries, contexts long enough to be split across threads, grouped-query heads,
shuffled block tables, and q/k/v as views into one projection. Both must write the same cache. A request's result
must not depend on its batch or on the number of threads; bad slots must raise instead of writing out of bounds;
bfloat16 caches take the torch path. A float16 cache stores keys and values rounded as torch rounds them and stays
within float16 rounding of the float32 cache's result; an int8 cache stores the bytes kv/cache.py's encode_int8
makes and stays within int8 rounding of it. With an int8 cache the chunk path may multiply in bfloat16 (queries
and softmax weights rounded): its rows are held to torch's result on bfloat16-rounded queries, within the
weights' rounding.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from tokenriver.kv.cache import decode_entries, encode_int8
from tokenriver.models.attention import paged_attention, paged_attention_torch
from tokenriver.models.attention_metadata import MAX_KERNEL_QUERY_LEN, AttentionMetadata
from tokenriver.models.cpu import fast_path as cpu_fast_path
from tokenriver.models.cpu.kernels import load_kernels

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="native kernels do not build on this machine")


@pytest.fixture(autouse=True)
def no_autograd():
    """The kernel runs only with autograd off, as in the model's forward (inference mode)."""
    with torch.inference_mode():
        yield


BLOCK_SIZE = 16


class Batch:
    """Random caches, shuffled block tables and fresh q/k/v for requests of the given (query_len, seq_len)."""

    def __init__(
        self,
        requests: list[tuple[int, int]],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        rng = random.Random(seed)
        generator = torch.Generator().manual_seed(seed)
        blocks_per_request = [-(-seq_len // BLOCK_SIZE) for _, seq_len in requests]
        num_blocks = sum(blocks_per_request) + 3
        pool = list(range(num_blocks))
        rng.shuffle(pool)
        self.tables, start = [], 0
        for count in blocks_per_request:
            self.tables.append(pool[start : start + count])
            start += count
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        encode = encode_int8 if cache_dtype == torch.int8 else (lambda x: x.to(cache_dtype or dtype))
        self.key_cache = encode(torch.randn(shape, generator=generator))
        self.value_cache = encode(torch.randn(shape, generator=generator))
        self.query_lens = [query_len for query_len, _ in requests]
        self.seq_lens = [seq_len for _, seq_len in requests]
        num_tokens = sum(self.query_lens)
        # [T, heads + 2 kv heads, head_dim]: q, k, v are views with a row stride wider than their own rows.
        self.qkv = (torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=generator) * 2).to(dtype)
        self.split = (num_heads, num_kv_heads, num_kv_heads)
        self.scale = head_dim**-0.5

    def run(
        self, function, tables: list[list[int]] | None = None, softcap: float | None = None, window: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output, key cache, value cache) after one call on fresh copies of the caches."""
        metadata = AttentionMetadata.build(self.query_lens, self.seq_lens, tables or self.tables, BLOCK_SIZE)
        kv_cache = (self.key_cache.clone(), self.value_cache.clone())
        query, key, value = self.qkv.split(self.split, dim=1)
        if function is paged_attention:
            native = self.qkv.dtype == torch.float32 and self.key_cache.dtype != torch.bfloat16
            scratch = (kv_cache[0].clone(), kv_cache[1].clone())
            took = cpu_fast_path.load().paged_attention(
                query, key, value, scratch, metadata, self.scale, window, softcap
            )
            assert (took is not None) == native
        return function(query, key, value, kv_cache, metadata, self.scale, window, softcap), *kv_cache


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    error = (got.double() - want.double()).abs().max().item()
    assert error <= rtol * want.abs().max().item(), f"max error {error:.3e}, max |want| {want.abs().max():.3e}"


def int8_rounded_queries(query: torch.Tensor) -> torch.Tensor:
    """Queries [..., head_dim] as the kernel rounds them for an int8 pool: to int8 per 32 head dimensions (zeros
    padding the last block), scale max|x| / 127, to nearest even."""
    head_dim = query.shape[-1]
    padded = -(-head_dim // 32) * 32
    blocks = torch.nn.functional.pad(query, (0, padded - head_dim)).unflatten(-1, (padded // 32, 32))
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    codes = torch.round(blocks / torch.where(scale > 0, scale, 1.0))
    return (codes * scale).flatten(-2)[..., :head_dim]


def assert_int8_close(batch: Batch, got: torch.Tensor, rtol: float = 1e-5, **options) -> None:
    """An int8 cache's result against torch's given the queries rounded as the kernel rounds them (int8 per 32
    head dimensions), within the softmax weights' rounding where the CPU multiplies values in bfloat16: each weight
    moves by at most 2^-8 of itself, so an output, a weighted mean of values, by at most 2^-8 of the largest
    |value|."""
    rounded = copy.copy(batch)
    rounded.qkv = batch.qkv.clone()
    rounded.qkv[:, : batch.split[0]] = int8_rounded_queries(batch.qkv[:, : batch.split[0]])
    want, _, values = rounded.run(paged_attention_torch, **options)
    error = (got - want).abs().max().item()
    largest_value = decode_entries(values, torch.float32).abs().max().item()
    assert error <= 2**-8 * largest_value + rtol * want.abs().max().item(), (error, largest_value)


RAGGED = [
    (1, 37),  # decode
    (1, 16),  # context ends on a block boundary
    (1, 1),  # first token
    (MAX_KERNEL_QUERY_LEN, 32),  # the longest chunk taken token by token, ending on a boundary
    (MAX_KERNEL_QUERY_LEN + 1, 50),  # the shortest one the chunk path takes
    (5, 20),  # short chunk straddling blocks
    (24, 24),  # a whole prompt
    (70, 70),  # a prompt of three blocks of query tokens, the last one partial
    (45, 300),  # a chunk after a cached prefix, its last tile partial
    (1, 1100),  # many splits (128 tokens each): partial results merged
    (2, 129),  # one token past a split
    (1, 128),  # exactly one split
]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 80), (4, 1, 256)]
)
def test_native_equals_torch_on_a_ragged_batch(num_heads, num_kv_heads, head_dim):
    batch = Batch(RAGGED, num_heads, num_kv_heads, head_dim)
    got, got_keys, got_values = batch.run(paged_attention)
    want, want_keys, want_values = batch.run(paged_attention_torch)
    assert got.shape == want.shape == (batch.qkv.shape[0], num_heads, head_dim)
    assert_close(got, want)
    assert torch.equal(got_keys, want_keys) and torch.equal(got_values, want_values)


@pytest.mark.parametrize("softcap,window", [(5.0, 0), (50.0, 0), (2.0, 40)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8], ids=["float32", "int8"])
def test_soft_capped_scores_equal_torch(softcap, window, cache_dtype):
    """Gemma 2's cap on the scores, in the per-token and the chunk path, alone and with a window: scores of the
    batch's scale (~3 to 10 in magnitude) are squeezed hard by a cap of 2 or 5 and barely by one of 50."""
    batch = Batch(RAGGED, 4, 1, 256, seed=5, cache_dtype=cache_dtype)
    got, *_ = batch.run(paged_attention, softcap=softcap, window=window)
    if cache_dtype == torch.int8:
        assert_int8_close(batch, got, rtol=1e-4, softcap=softcap, window=window)
    else:
        want, *_ = batch.run(paged_attention_torch, softcap=softcap, window=window)
        assert_close(got, want)
    uncapped, *_ = batch.run(paged_attention, window=window)
    assert not torch.allclose(got, uncapped)


def test_many_decodes_take_the_threaded_path():
    batch = Batch([(1, 100 + 37 * i) for i in range(24)], 9, 3, 64, seed=3)
    got, *_ = batch.run(paged_attention)
    want, *_ = batch.run(paged_attention_torch)
    assert_close(got, want)


def test_out_of_range_slot_raises_without_writing():
    batch = Batch([(1, 20)], 9, 3, 64)
    metadata = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.tables, BLOCK_SIZE)
    metadata.slot_mapping = torch.tensor([batch.key_cache.shape[0] * BLOCK_SIZE])  # one past the pool
    kv_cache = (batch.key_cache.clone(), batch.value_cache.clone())
    query, key, value = batch.qkv.split(batch.split, dim=1)
    with pytest.raises(IndexError, match="out of range"):
        paged_attention(query, key, value, kv_cache, metadata, batch.scale)
    assert torch.equal(kv_cache[0], batch.key_cache) and torch.equal(kv_cache[1], batch.value_cache)


def test_bfloat16_cache_takes_the_torch_path():
    batch = Batch(RAGGED[:6], 9, 3, 64, dtype=torch.bfloat16)
    got, got_keys, _ = batch.run(paged_attention)
    want, want_keys, _ = batch.run(paged_attention_torch)
    assert torch.equal(got, want) and torch.equal(got_keys, want_keys)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128)])
def test_float16_cache_native_equals_torch(num_heads, num_kv_heads, head_dim):
    batch = Batch(RAGGED, num_heads, num_kv_heads, head_dim, seed=7, cache_dtype=torch.float16)
    got, got_keys, got_values = batch.run(paged_attention)
    want, want_keys, want_values = batch.run(paged_attention_torch)
    assert got.dtype == torch.float32 and got_keys.dtype == torch.float16
    assert_close(got, want)
    # Stored as torch's .to(float16) rounds: to nearest, ties to even.
    assert torch.equal(got_keys, want_keys) and torch.equal(got_values, want_values)
    query_len_total = batch.qkv.shape[0]
    _, key, value = batch.qkv.split(batch.split, dim=1)
    slots = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.tables, BLOCK_SIZE).slot_mapping
    assert slots.shape[0] == query_len_total
    assert torch.equal(got_keys.view(-1, num_kv_heads, head_dim)[slots], key.to(torch.float16))
    assert torch.equal(got_values.view(-1, num_kv_heads, head_dim)[slots], value.to(torch.float16))


def test_float16_cache_is_within_its_rounding_of_the_float32_cache():
    wide = Batch(RAGGED, 9, 3, 64, seed=8)
    narrow = Batch(RAGGED, 9, 3, 64, seed=8, cache_dtype=torch.float16)
    assert torch.equal(narrow.key_cache, wide.key_cache.to(torch.float16))
    got, *_ = narrow.run(paged_attention)
    want, *_ = wide.run(paged_attention)
    error = (got - want).abs().max().item()
    # Keys and values each carry a relative error of at most 2^-11. Scores here reach |q| |k| / sqrt(d) ~ 16, so a
    # score moves by up to ~16 * 2^-11 ~ 0.008, and the output (a weighted mean of O(1) values) by about as much.
    assert 0 < error < 2e-2, error


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (6, 1, 80), (4, 1, 256)])
def test_int8_cache_native_equals_torch(num_heads, num_kv_heads, head_dim):
    batch = Batch(RAGGED, num_heads, num_kv_heads, head_dim, seed=10, cache_dtype=torch.int8)
    got, got_keys, got_values = batch.run(paged_attention)
    want, want_keys, want_values = batch.run(paged_attention_torch)
    assert got.dtype == torch.float32 and got_keys.shape[-1] == head_dim + 4
    assert_int8_close(batch, got)
    # The kernel stores the bytes encode_int8 makes: the same scale, the same rounding of every value.
    assert torch.equal(got_keys, want_keys) and torch.equal(got_values, want_values)
    _, key, _ = batch.qkv.split(batch.split, dim=1)
    slots = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.tables, BLOCK_SIZE).slot_mapping
    assert torch.equal(got_keys.view(-1, num_kv_heads, head_dim + 4)[slots], encode_int8(key))


def test_int8_entries_round_each_value_to_within_half_a_step():
    vectors = torch.randn(50, 3, 64) * torch.rand(50, 3, 1) * 10
    vectors[0, 0] = 0.0  # an all-zero vector: scale 0, values 0
    decoded = decode_entries(encode_int8(vectors), torch.float32)
    step = vectors.abs().amax(dim=-1, keepdim=True) / 127
    assert bool(((decoded - vectors).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all())
    assert torch.equal(decoded[0, 0], torch.zeros(64))


def test_int8_cache_is_within_its_rounding_of_the_float32_cache():
    wide = Batch(RAGGED, 9, 3, 64, seed=11)
    narrow = Batch(RAGGED, 9, 3, 64, seed=11, cache_dtype=torch.int8)
    got, *_ = narrow.run(paged_attention)
    want, *_ = wide.run(paged_attention)
    error = (got - want).abs().max().item()
    # Each stored value moves by at most half a step, max|x| / 254: ~0.013 for these unit normal vectors (largest
    # value ~3.4 of 64), ~27 times float16's rounding of such a value (2^-11 relative), whose test above allows 2e-2.
    # Measured at the time of writing: 0.14.
    assert 0 < error < 0.3, error


def attend_pieces(whole: Batch, kv_cache, pieces: list[tuple[int, int]], decodes: bool, **options) -> torch.Tensor:
    """The outputs of whole's prompt tokens [start, end) of each piece, computed as a chunk after the tokens before
    it (or, with decodes, token by token as decoding requests in one call), batched with a 7-token prompt of
    another request."""
    query, key, value = whole.qkv.split(whole.split, dim=1)
    spare = next(b for b in range(kv_cache[0].shape[0]) if b not in whole.tables[0])
    other = torch.randn(7, *whole.qkv.shape[1:], generator=torch.Generator().manual_seed(1))
    other_query, other_key, other_value = other.split(whole.split, dim=1)
    outputs = []
    for start, end in pieces:
        if decodes:
            query_lens, seq_lens = [1] * (end - start) + [7], [*range(start + 1, end + 1), 7]
            tables = [whole.tables[0]] * (end - start) + [[spare]]
        else:
            query_lens, seq_lens, tables = [end - start, 7], [end, 7], [whole.tables[0], [spare]]
        metadata = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
        out = paged_attention(
            torch.cat([query[start:end], other_query]),
            torch.cat([key[start:end], other_key]),
            torch.cat([value[start:end], other_value]),
            kv_cache,
            metadata,
            whole.scale,
            options.get("window", 0),
            options.get("softcap"),
        )
        outputs.append(out[: end - start])
    return torch.cat(outputs)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8], ids=["float32", "float16", "int8"])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,window,softcap",
    [(9, 3, 64, 0, None), (6, 1, 80, 0, None), (8, 2, 128, 100, 50.0), (4, 1, 256, 40, None), (4, 1, 256, 0, 5.0)],
)
def test_a_query_token_has_one_result_however_it_is_computed(
    cache_dtype, num_heads, num_kv_heads, head_dim, window, softcap
):
    """A 300-token prompt (three splits, its last tile partial) attended whole, with 1 and with 2 threads; in
    chunks of 37, 2, 100 and 161 tokens; and its last 45 tokens decoded one by one: every token's output the same
    bits, whatever its chunk, its batch or the thread count."""
    whole = Batch([(300, 300)], num_heads, num_kv_heads, head_dim, seed=9, cache_dtype=cache_dtype)
    options = {"window": window, "softcap": softcap}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single_thread, *_ = whole.run(paged_attention, **options)
        torch.set_num_threads(2)
        got_whole, key_cache, value_cache = whole.run(paged_attention, **options)
        chunked = attend_pieces(
            whole, (key_cache, value_cache), [(0, 37), (37, 39), (39, 139), (139, 300)], False, **options
        )
        decoded = attend_pieces(whole, (key_cache, value_cache), [(255, 300)], True, **options)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single_thread, got_whole)
    assert torch.equal(chunked, got_whole)
    assert torch.equal(decoded, got_whole[255:])


def test_an_out_of_range_chunk_raises():
    batch = Batch([(20, 40)], 9, 3, 64)
    metadata = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.tables, BLOCK_SIZE)
    metadata.kernel_chunks = torch.tensor([[0, 0, 20, 40 + BLOCK_SIZE * 8]])  # more context than its blocks hold
    query, key, value = batch.qkv.split(batch.split, dim=1)
    with pytest.raises(IndexError, match="out of range"):
        paged_attention(query, key, value, (batch.key_cache.clone(), batch.value_cache.clone()), metadata, batch.scale)
