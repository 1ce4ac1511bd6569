"""The Triton kernels of a layer's small ops (models/cuda/fused_ops.py) and of decode attention
(models/cuda/paged_decode.py) against their PyTorch definitions.

On a machine with an NVIDIA GPU they compile and run there, bfloat16 included. Without one they run in Triton's
interpreter on CPU tensors (float32 and float16: the interpreter has no bfloat16), which checks the indexing, the
masks of odd shapes, the strided views and the rounding points, not speed.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from tokenriver.models.layers import apply_rotary, gelu_tanh_and_mul_torch, rms_norm_torch, silu_and_mul_torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# exp overflows to inf on purpose where an activation saturates; the interpreter's NumPy warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
NEEDS_GPU = [pytest.mark.cuda, pytest.mark.skipif(not ON_GPU, reason="the interpreter has no bfloat16")]
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=NEEDS_GPU)]


def _load(name: str):
    """The kernel module; without a GPU, tests/conftest.py has put Triton in its interpreter before any import."""
    pytest.importorskip("triton", reason="triton is not installed: the CUDA kernels are untested")
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def ops():
    return _load("tokenriver.models.cuda.fused_ops")


@pytest.fixture(scope="module")
def decode():
    return _load("tokenriver.models.cuda.paged_decode")


def _rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(DEVICE)


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in units of the dtype's roundoff at the values' size."""
    eps = torch.finfo(want.dtype).eps
    diff = (got.double() - want.double()).abs()
    return float((diff / (want.double().abs() * eps + torch.finfo(want.dtype).tiny)).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("columns", [7, 100, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_its_definition(ops, dtype, columns, with_residual):
    wide = _rand(5, columns + 3, dtype=dtype, seed=columns)
    x = wide[:, :columns]  # rows spaced apart, as a view into a wider tensor
    weight = _rand(columns, dtype=dtype, seed=1)
    residual = _rand(5, columns, dtype=dtype, seed=2) if with_residual else None
    want_residual = None if residual is None else residual.clone()
    want = rms_norm_torch(x.clone(), weight, 1e-5, want_residual)
    got = ops.rms_norm(x, weight, 1e-5, residual)
    assert got.dtype == want.dtype and got.shape == want.shape
    if residual is not None:
        assert torch.equal(residual, want_residual)  # the add rounds once, as residual.add_ does
    # The sum of squares is added in another order: a 16-bit result may land one rounding away.
    assert _ulps(got, want) <= (16.0 if dtype == torch.float32 else 2.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_float32_weight_on_16_bit_rows_promotes_as_torch_does(ops, dtype):
    x, weight = _rand(3, 64, dtype=dtype, seed=3), _rand(64, dtype=torch.float32, seed=4)
    got, want = ops.rms_norm(x, weight, 1e-6), rms_norm_torch(x, weight, 1e-6)
    assert got.dtype == want.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, rotary_dim", [(4, 2, 64, 64), (3, 1, 80, 80), (4, 4, 96, 32)]
)
def test_rotary_in_place_on_views_of_the_qkv_row(ops, dtype, num_heads, num_kv_heads, head_dim, rotary_dim):
    tokens = 6
    qkv = _rand(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=head_dim)
    heads = qkv.view(tokens, -1, head_dim)[:, : num_heads + num_kv_heads, :rotary_dim]  # query and key heads
    angles = torch.rand(tokens, 1, rotary_dim // 2, generator=torch.Generator().manual_seed(5)) * 6
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    want = apply_rotary(heads.clone(), cos, sin)
    untouched = qkv.view(tokens, -1, head_dim)[:, num_heads + num_kv_heads :].clone()  # the value heads
    rest = qkv.view(tokens, -1, head_dim)[:, :, rotary_dim:].clone()
    ops.rotary_(heads, cos, sin)
    assert torch.equal(qkv.view(tokens, -1, head_dim)[:, num_heads + num_kv_heads :], untouched)
    assert torch.equal(qkv.view(tokens, -1, head_dim)[:, :, rotary_dim:], rest)
    if dtype == torch.float32:
        assert torch.allclose(heads, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(heads, want)  # each product and sum rounded where PyTorch's ops round them


def test_rounding_to_bfloat16_on_the_bits_matches_torch(ops):
    """The kernels' bfloat16 rounding, run where the interpreter has no bfloat16: float32 in, float32 out, against
    PyTorch's cast. Ties (both parities), carries into the exponent, overflow to inf, subnormals and signs."""
    import triton
    import triton.language as tl

    global _fused_ops  # a Triton kernel resolves the functions it calls among its module's globals
    _fused_ops = ops

    @triton.jit
    def round_kernel(x_ptr, out_ptr, count, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        mask = offsets < count
        tl.store(out_ptr + offsets, _fused_ops._rounded(tl.load(x_ptr + offsets, mask=mask), tl.bfloat16), mask=mask)

    bits = torch.tensor(
        [
            0x3F808000,
            0x3F818000,
            0x3F80FFFF,
            0x3FFF8000,
            0x7F7FFFFF,
            0x00018000,
            0x80018001,
            0x00000000,
            0x80000000,
            0xBF7FC000,
        ],
        dtype=torch.int64,
    ).to(torch.int32)
    special = bits.view(torch.float32)
    x = torch.cat([special, _rand(1000, dtype=torch.float32, seed=9).cpu() * 1e3]).to(DEVICE)
    out = torch.empty_like(x)
    round_kernel[(1,)](x, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    assert torch.equal(out, x.to(torch.bfloat16).to(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("columns", [5, 1536, 1500])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activations_match_their_definitions(ops, dtype, columns, activation):
    gate_up = _rand(4, 2 * columns, dtype=dtype, seed=columns, scale=3.0)
    kernel, definition = (
        (ops.silu_and_mul, silu_and_mul_torch)
        if activation == "silu"
        else (ops.gelu_tanh_and_mul, gelu_tanh_and_mul_torch)
    )
    got, want = kernel(gate_up), definition(gate_up)
    assert got.dtype == want.dtype and got.shape == want.shape
    # Within the exponential's last bits. Where gelu's output is tiny (a large negative gate) PyTorch's
    # 0.5 g (1 + tanh) cancels, off by up to ~eps |g| before the product with up; the kernel's sigmoid form does not.
    eps = torch.finfo(dtype).eps
    gate, up = (half.double().abs() for half in gate_up.chunk(2, dim=-1))
    error = (got.double() - want.double()).abs()
    bound = (16 if dtype == torch.float32 else 1) * eps * want.double().abs() + 2 * eps * gate * up
    assert bool((error <= bound).all())


def _reference_decode(query, key_cache, value_cache, tables, lengths, scale, window=0, softcap=None):
    """Each token over its gathered context in float64."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for b, length in enumerate(lengths.tolist()):
        slots = [tables[b, p // block_size].item() * block_size + p % block_size for p in range(length)]
        keys = key_cache.reshape(-1, num_kv_heads, key_cache.shape[3])[slots].double().cpu()  # [S, kv, d]
        values = value_cache.reshape(-1, num_kv_heads, key_cache.shape[3])[slots].double().cpu()
        q = query[b].double().cpu()  # [heads, d]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,shd->hs", q, keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if window > 0:
            scores[:, : max(0, length - window)] = float("-inf")
        out[b] = torch.einsum("hs,shd->hd", torch.softmax(scores, dim=-1), values)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 64), (6, 2, 80), (2, 2, 32), (8, 1, 64)])
@pytest.mark.parametrize("window, softcap", [(0, None), (20, None), (0, 30.0), (7, 5.0)])
def test_paged_decode_attention_matches_the_gathered_context(
    decode, dtype, num_heads, num_kv_heads, head_dim, window, softcap
):
    block_size, num_blocks = 16, 24
    key_cache = _rand(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=1)
    value_cache = _rand(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=2)
    lengths = torch.tensor([1, 16, 17, 70, 33], device=DEVICE)  # one slot, a whole block, past one, several
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3))
    tables = torch.stack([order[b * 4 : b * 4 + 6] for b in range(len(lengths))]).to(DEVICE)  # blocks out of order
    wide = _rand(len(lengths), num_heads + 2, head_dim, dtype=dtype, seed=4)
    query = wide[:, :num_heads]  # rows spaced apart, as a view of the qkv row
    got = decode.paged_decode_attention(query, key_cache, value_cache, tables, lengths, head_dim**-0.5, window, softcap)
    want = _reference_decode(query, key_cache, value_cache, tables, lengths, head_dim**-0.5, window, softcap)
    assert got.dtype == dtype and got.shape == query.shape
    error = (got.double().cpu() - want).norm() / want.norm()
    assert error < (1e-5 if dtype == torch.float32 else 5e-3)
    into = torch.full(query.shape, float("nan"), dtype=dtype, device=DEVICE)  # the caller's buffer, written in place
    assert (
        decode.paged_decode_attention(
            query, key_cache, value_cache, tables, lengths, head_dim**-0.5, window, softcap, out=into
        )
        is into
    )
    assert torch.equal(into, got)


def _long_contexts(dtype, num_heads, num_kv_heads, head_dim, width):
    """Contexts around and past one partition, blocks out of order, tables `width` blocks wide."""
    block_size, lengths = 16, [1, 511, 512, 513, 1300]
    num_blocks = len(lengths) * width
    key_cache = _rand(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=1)
    value_cache = _rand(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=2)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3))
    tables = order.view(len(lengths), width).to(DEVICE)
    query = _rand(len(lengths), num_heads, head_dim, dtype=dtype, seed=4)
    return query, key_cache, value_cache, tables, torch.tensor(lengths, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 64), (8, 1, 32)])
@pytest.mark.parametrize("window, softcap", [(0, None), (700, None), (0, 30.0)])
def test_paged_decode_attention_splits_long_contexts(decode, dtype, num_heads, num_kv_heads, head_dim, window, softcap):
    """Contexts past PARTITION positions are split and merged; with a window the first partitions hold nothing."""
    query, key_cache, value_cache, tables, lengths = _long_contexts(dtype, num_heads, num_kv_heads, head_dim, 100)
    got = decode.paged_decode_attention(query, key_cache, value_cache, tables, lengths, head_dim**-0.5, window, softcap)
    want = _reference_decode(query, key_cache, value_cache, tables, lengths, head_dim**-0.5, window, softcap)
    for row in range(len(lengths)):
        error = (got[row].double().cpu() - want[row]).norm() / want[row].norm()
        assert error < (1e-5 if dtype == torch.float32 else 5e-3), (row, float(error))


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention_result_does_not_depend_on_the_batch(decode, dtype):
    """A request alone, with a table just wide enough for it (one partition up to PARTITION positions), gets the
    bits it gets in a batch whose tables are wider (more partitions, the extra ones empty)."""
    query, key_cache, value_cache, tables, lengths = _long_contexts(dtype, 4, 2, 64, 200)
    scale = 64**-0.5
    batched = decode.paged_decode_attention(query, key_cache, value_cache, tables, lengths, scale, window=600)
    for row, length in enumerate(lengths.tolist()):
        blocks = -(-length // 16)
        alone = decode.paged_decode_attention(
            query[row : row + 1],
            key_cache,
            value_cache,
            tables[row : row + 1, :blocks],
            lengths[row : row + 1],
            scale,
            window=600,
        )
        assert torch.equal(alone[0], batched[row]), row


def test_paged_decode_attention_refuses_an_output_buffer_it_cannot_fill(decode):
    query, cache = torch.zeros(2, 4, 64), torch.zeros(3, 16, 2, 64)
    tables, lengths = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long)
    for out in (torch.zeros(2, 4, 32), torch.zeros(2, 4, 64, dtype=torch.float16), torch.zeros(2, 64, 4).mT):
        with pytest.raises(ValueError, match="out must be a contiguous"):
            decode.paged_decode_attention(query, cache, cache, tables, lengths, 0.125, out=out)


def test_paged_decode_attention_takes_only_what_it_can_read(decode):
    query = torch.zeros(2, 4, 64)
    assert decode.fits(query, torch.zeros(3, 16, 2, 64))
    assert not decode.fits(query, torch.zeros(3, 16, 2, 64, dtype=torch.float16))  # another dtype: rounded cache
    assert not decode.fits(query, torch.zeros(3, 16, 3, 64))  # 4 heads over 3 kv heads
    assert not decode.fits(query, torch.zeros(3, 16, 2, 68, dtype=torch.int8))  # the int8 layout


@pytest.fixture(scope="module")
def kv_write():
    return _load("tokenriver.models.cuda.kv_write")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 64), (6, 3, 80), (8, 1, 256)])
def test_kv_write_stores_each_token_in_its_slot(kv_write, dtype, num_heads, num_kv_heads, head_dim):
    """As attention.write_kv's index_copy_ does, from the key and value views of a qkv row."""
    block_size, num_blocks = 16, 6
    key_cache = _rand(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=1)
    value_cache = _rand(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=2)
    want_keys, want_values = key_cache.clone(), value_cache.clone()
    qkv = _rand(5, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, seed=3)
    _, key, value = qkv.split((num_heads, num_kv_heads, num_kv_heads), dim=1)
    slots = torch.tensor([0, 17, 95, 40, 41], device=DEVICE)  # a block's first and last, out of order
    assert kv_write.fits(key, value, key_cache)
    kv_write.write_kv(key, value, key_cache, value_cache, slots)
    want_keys.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    want_values.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)
    assert torch.equal(key_cache, want_keys) and torch.equal(value_cache, want_values)


def test_kv_write_takes_only_what_it_can_store(kv_write):
    key, cache = torch.zeros(3, 2, 64), torch.zeros(4, 16, 2, 64)
    assert kv_write.fits(key, key, cache)
    assert not kv_write.fits(key, key, cache.half())  # a cache in another dtype rounds: PyTorch's path
    assert not kv_write.fits(key, key, torch.zeros(4, 16, 2, 68, dtype=torch.int8))  # int8 entries with a scale
    assert not kv_write.fits(key, key, torch.zeros(4, 16, 1, 64))  # other heads
    assert not kv_write.fits(key.mT.contiguous().mT, key, cache)  # a head's values spaced apart
