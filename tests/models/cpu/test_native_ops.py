"""The native small ops of a layer (models/cpu/csrc/ops.cpp) against their PyTorch definitions in models/layers.py.

Each dispatching function (`rms_norm`, `apply_rotary_`, `silu_and_mul`, `gelu_tanh_and_mul`) takes the native
kernel for float32 CPU tensors; the `*_torch` functions (and `apply_rotary`) are the definitions it must reproduce.
Shapes cover one row (decode), many rows (the threaded path) and widths that are not multiples of the 8-float
vectors. Other dtypes and layouts must fall back to the definitions exactly. Finally a small random model must give
the same logits with and without any native kernel, in float32 and bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from tokenriver.kv.cache import KVCache
from tokenriver.models.attention import AttentionMetadata
from tokenriver.models.config import ModelConfig
from tokenriver.models.cpu import fast_path as cpu_fast_path
from tokenriver.models.cpu.kernels import load_kernels
from tokenriver.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_,
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_torch,
    rms_norm,
    rms_norm_torch,
    silu_and_mul,
    silu_and_mul_torch,
)
from tokenriver.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="native kernels do not build on this machine")


@pytest.fixture(autouse=True)
def no_autograd():
    """The kernels run only with autograd off, as in the model's forward (inference mode)."""
    with torch.inference_mode():
        yield


def test_the_native_kernels_run_and_only_without_autograd(monkeypatch):
    kernels = load_kernels()
    calls: list[str] = []
    for name in ("rms_norm", "rotary_", "silu_mul"):

        def recorded(*args, _name=name, _original=getattr(kernels, name)):
            calls.append(_name)
            return _original(*args)

        monkeypatch.setattr(kernels, name, recorded)
    x, weight = torch.randn(2, 64), torch.rand(64)
    cos, sin = RotaryEmbedding(64, 10000.0, None, 4096)(torch.arange(2), torch.float32)
    rms_norm(x, weight, 1e-6)
    apply_rotary_(torch.randn(2, 4, 64), torch.randn(2, 2, 64), cos, sin)
    silu_and_mul(torch.randn(2, 64))
    assert calls == ["rms_norm", "rotary_", "silu_mul"]
    with torch.inference_mode(False), torch.enable_grad():
        trained = torch.rand(64, requires_grad=True)
        out = rms_norm(torch.randn(2, 64), trained, 1e-6)
        assert out.requires_grad and calls == ["rms_norm", "rotary_", "silu_mul"]


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    """Max elementwise error within rtol of the largest magnitude (float32 rounding, not a wrong formula)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    error = (got.double() - want.double()).abs().max().item()
    assert error <= rtol * want.abs().max().item(), f"max error {error:.3e}, max |want| {want.abs().max():.3e}"


@pytest.mark.parametrize("num_rows", [1, 7, 200])
@pytest.mark.parametrize("width", [576, 100])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_equals_definition(num_rows, width, with_residual):
    torch.manual_seed(num_rows * width)
    x, weight = torch.randn(num_rows, width) * 3, torch.rand(width) + 0.5
    residual = torch.randn(num_rows, width) if with_residual else None
    want_residual = None if residual is None else residual.clone()
    want = rms_norm_torch(x, weight, 1e-5, want_residual)
    got = rms_norm(x, weight, 1e-5, residual)
    assert_close(got, want)
    if with_residual:
        # The fused add is the same single float32 addition: bit for bit, and done in place.
        assert torch.equal(residual, want_residual)


def test_rms_norm_falls_back_for_bfloat16_and_strided_input():
    torch.manual_seed(0)
    x, weight = torch.randn(5, 64).bfloat16(), (torch.rand(64) + 0.5).bfloat16()
    residual = torch.randn(5, 64).bfloat16()
    want_residual = residual.clone()
    assert torch.equal(rms_norm(x, weight, 1e-6, residual), rms_norm_torch(x, weight, 1e-6, want_residual))
    assert torch.equal(residual, want_residual)
    strided = torch.randn(64, 5).t()  # [5, 64], not contiguous
    assert torch.equal(rms_norm(strided, weight.float(), 1e-6), rms_norm_torch(strided, weight.float(), 1e-6))


def test_add_and_norm_starts_and_extends_the_residual_stream():
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    first, second = torch.randn(3, 64), torch.randn(3, 64)
    normed, residual = norm.add_and_norm(first, None)
    assert residual is first and torch.equal(normed, norm(first))
    expected_sum = first + second
    normed, residual = norm.add_and_norm(second, residual)
    assert torch.equal(residual, expected_sum)
    assert_close(normed, rms_norm_torch(expected_sum, norm.weight.detach(), 1e-5))


@pytest.mark.parametrize("num_tokens", [1, 5, 300])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 1, 128), (2, 2, 40)])
def test_rotary_in_place_equals_definition(num_tokens, num_heads, num_kv_heads, head_dim):
    torch.manual_seed(num_tokens)
    rope = RotaryEmbedding(head_dim, 10000.0, None, 4096)
    cos, sin = rope(torch.randint(0, 5000, (num_tokens,)), torch.float32)
    # q and k as views into one fused projection, as the model has them.
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    query, key, _ = qkv.split((num_heads, num_kv_heads, num_kv_heads), dim=1)
    want_query, want_key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
    value_before = qkv[:, num_heads + num_kv_heads :].clone()
    apply_rotary_(query, key, cos, sin)
    # Same products and sums in the same order (the kernels are built with -ffp-contract=off): bit for bit.
    assert torch.equal(query, want_query) and torch.equal(key, want_key)
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], value_before)


@pytest.mark.parametrize("num_tokens", [1, 7])
def test_partial_rotary_turns_only_the_first_values_of_each_head(num_tokens):
    """Phi-4-mini's partial rotary: the views of the first 24 of 32 values of each head turn as the definition
    says, in place, and the last 8 of each head stay as they were."""
    torch.manual_seed(num_tokens)
    cos, sin = RotaryEmbedding(24, 10000.0, None, 4096)(torch.randint(0, 500, (num_tokens,)), torch.float32)
    qkv = torch.randn(num_tokens, 6 + 2 * 2, 32)
    query, key, _ = qkv.split((6, 2, 2), dim=1)
    want_query, want_key = apply_rotary(query[..., :24], cos, sin), apply_rotary(key[..., :24], cos, sin)
    before = qkv.clone()
    apply_rotary_(query[..., :24], key[..., :24], cos, sin)
    assert torch.equal(query[..., :24], want_query) and torch.equal(key[..., :24], want_key)
    assert torch.equal(qkv[..., 24:], before[..., 24:]) and torch.equal(qkv[:, 8:], before[:, 8:])


def test_rotary_falls_back_for_bfloat16():
    torch.manual_seed(0)
    cos, sin = RotaryEmbedding(64, 10000.0, None, 4096)(torch.arange(6), torch.bfloat16)
    query, key = torch.randn(6, 4, 64).bfloat16(), torch.randn(6, 2, 64).bfloat16()
    want_query, want_key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
    apply_rotary_(query, key, cos, sin)
    assert torch.equal(query, want_query) and torch.equal(key, want_key)


@pytest.mark.parametrize("num_rows", [1, 3, 100])
@pytest.mark.parametrize("intermediate", [1536, 20])
def test_silu_and_mul_equals_definition(num_rows, intermediate):
    torch.manual_seed(num_rows)
    gate_up = torch.randn(num_rows, 2 * intermediate) * 8
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, -87.5, 0.0])  # far tails and zero
    assert_close(silu_and_mul(gate_up), silu_and_mul_torch(gate_up))


def test_a_released_thread_pool_comes_back_with_the_next_parallel_work():
    gate_up = torch.randn(64, 2 * 1536)
    before = silu_and_mul(gate_up)
    assert load_kernels().release_thread_pool()
    assert torch.equal(silu_and_mul(gate_up), before)
    cpu_fast_path.release_thread_pool()
    assert torch.equal(silu_and_mul(gate_up), before)


def test_releasing_a_pool_never_builds_the_kernels():
    load_kernels.cache_clear()
    try:
        cpu_fast_path.release_thread_pool()
        assert load_kernels.cache_info().currsize == 0
    finally:
        load_kernels()


def test_silu_and_mul_falls_back_for_bfloat16():
    gate_up = torch.randn(4, 64).bfloat16()
    assert torch.equal(silu_and_mul(gate_up), silu_and_mul_torch(gate_up))


@pytest.mark.parametrize("num_rows", [1, 3, 100])
@pytest.mark.parametrize("intermediate", [1536, 20, 5])
def test_gelu_tanh_and_mul_equals_torchs_gelu(num_rows, intermediate):
    """Within 1e-6 relative of F.gelu(approximate="tanh") * up wherever PyTorch's own float32 result is precise
    (gate > -1.5: below, its 1 + tanh(u) cancels), within 1e-6 of |up| everywhere; the far tails and zeros."""
    torch.manual_seed(num_rows)
    gate_up = torch.randn(num_rows, 2 * intermediate) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    got, want = gelu_tanh_and_mul(gate_up), gelu_tanh_and_mul_torch(gate_up)
    precise = (gate > -1.5) & (want != 0)
    relative = ((got - want).abs() / want.abs())[precise]
    assert relative.max().item() <= 1e-6, relative.max().item()
    assert ((got - want).abs() <= 1e-6 * up.abs()).all()


def test_gelu_tanh_and_mul_falls_back_for_bfloat16():
    gate_up = torch.randn(4, 64).bfloat16()
    assert torch.equal(gelu_tanh_and_mul(gate_up), gelu_tanh_and_mul_torch(gate_up))


def tiny_model(dtype: torch.dtype) -> LlamaForCausalLM:
    config = ModelConfig(
        architecture="llama",
        vocab_size=97,
        hidden_size=96,
        intermediate_size=160,
        num_layers=3,
        num_heads=6,
        num_kv_heads=2,
        head_dim=32,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0, 0.2)
    return model.to(dtype)


def run_chunks(model: LlamaForCausalLM, token_ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits of every token, fed in the given chunk sizes (a prefill, short chunks, one-token decodes)."""
    config = model.config
    dtype = next(model.parameters()).dtype
    cache = KVCache(config.num_layers, 8, 16, config.num_kv_heads, config.head_dim, dtype)
    table = [5, 2, 7, 0, 3, 1, 6, 4]  # out of order, as after other requests came and went
    logits, done = [], 0
    for chunk in chunks:
        metadata = AttentionMetadata.build([chunk], [done + chunk], [table], 16)
        hidden = model(torch.tensor(token_ids[done : done + chunk]), torch.arange(done, done + chunk), cache, metadata)
        logits.append(model.compute_logits(hidden))
        done += chunk
    return torch.cat(logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_equals_itself_without_native_kernels(dtype, monkeypatch):
    model = tiny_model(dtype)
    token_ids = torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    chunks = [20, 3, 16, 1, 1, 17, 1, 1]  # SDPA prefill, kernel chunks at the limit, decodes across blocks
    native = run_chunks(model, token_ids, chunks)
    monkeypatch.setattr(cpu_fast_path, "load", lambda: None)  # every op of the model takes its definition
    torch_only = run_chunks(model, token_ids, chunks)
    if dtype == torch.float32:
        assert_close(native, torch_only)
    else:
        # bfloat16 takes the torch definitions everywhere: the same ops, the same bits.
        assert torch.equal(native, torch_only)


@pytest.mark.parametrize("num_rows, vocab_size", [(1, 49152), (64, 49152), (3, 7), (5, 100), (2, 8), (4, 33)])
def test_argmax_logsumexp_equals_torch(num_rows, vocab_size):
    kernels = load_kernels()
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(vocab_size)) * 4
    # Ties: the first of equal maxima wins, in the vector part, across lanes and in the scalar tail.
    logits[0, vocab_size // 2] = logits[0, vocab_size - 1] = 100.0
    if num_rows > 1:
        logits[1, 3] = logits[1, 1] = 100.0
    argmax, max_logits, lse = kernels.argmax_logsumexp(logits)
    assert torch.equal(argmax, logits.argmax(dim=1))
    assert torch.equal(max_logits, logits.max(dim=1).values)
    torch.testing.assert_close(lse, torch.logsumexp(logits.double(), dim=1).float(), rtol=1e-6, atol=1e-5)


def test_argmax_logsumexp_declines_what_it_cannot_compute():
    kernels = load_kernels()
    assert kernels.argmax_logsumexp(torch.full((2, 20), float("-inf"))) is None
    with_nan = torch.randn(3, 50)
    with_nan[1, 17] = float("nan")
    assert kernels.argmax_logsumexp(with_nan) is None
    assert kernels.argmax_logsumexp(torch.randn(4, 10).t()) is None  # not contiguous
    assert kernels.argmax_logsumexp(torch.randn(4, 10, dtype=torch.bfloat16)) is None


@pytest.mark.skipif(load_kernels() is None, reason="native kernels unavailable")
def test_moe_routing_matches_softmax_top_k_and_survives_a_damaged_router():
    """The router's softmax, top-k (largest first) and renormalization, as PyTorch computes them; a row of NaN
    logits still names valid, distinct experts, so no expert index can run out of bounds."""
    kernels = load_kernels()
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 16, generator=generator)
    experts, weights = kernels.moe_route(logits, 4, True)
    probabilities = torch.softmax(logits, dim=-1)
    want_weights, want_experts = probabilities.topk(4, dim=-1)
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(weights, want_weights / want_weights.sum(dim=-1, keepdim=True))
    logits[2] = float("nan")
    logits[3, 5] = float("nan")
    experts, _ = kernels.moe_route(logits, 4, False)
    assert bool(((experts >= 0) & (experts < 16)).all())
    assert all(len(set(row.tolist())) == 4 for row in experts)
    assert 5 not in experts[3].tolist()
    with pytest.raises(ValueError, match="top_k"):
        kernels.moe_route(logits, 17, False)
