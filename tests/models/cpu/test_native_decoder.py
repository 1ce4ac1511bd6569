"""The decoder stack in one native call (models/cpu/decoder.py, through runner/native_stack.py) against the same
layers run one module at a time (the model's own forward).

Both paths call the same kernels in the same order, so every step's hidden states must be equal bit for bit:
decode steps, short multi-token steps (speculative verification), batches above the GEMV/GEMM switch, int4 and
int8 weights, biased projections, float32 and float16 KV pools. Steps it cannot run (long prompt chunks, a float
model) take the modules. The same holds for the other layouts: Qwen3 (q/k norms, sliding windows) and Gemma 3
(q/k norms, norms on both sides of each block, GeGLU, a local rope base on the sliding layers); Gemma 2's
soft-capped attention and mixture-of-experts MLPs stay on the modules.
"""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch

from tokenriver.decoding.draft_model import first_layers
from tokenriver.kv.cache import KVCache
from tokenriver.models.attention import AttentionMetadata
from tokenriver.models.config import ModelConfig
from tokenriver.models.cpu.decoder import NativeDecoder
from tokenriver.models.cpu.kernels import load_kernels
from tokenriver.models.gemma import GemmaForCausalLM
from tokenriver.models.kquant import KQuantLinear, concatenate_kquant, pack_records
from tokenriver.models.llama import LlamaForCausalLM
from tokenriver.models.phi3 import Phi3ForCausalLM
from tokenriver.models.quant import Int4Linear, Int8Linear, quantize_int4, quantize_int8
from tokenriver.models.qwen3 import Qwen3ForCausalLM
from tokenriver.models.registry import model_class
from tokenriver.models.stacked import KQuantStack, StackedLinear
from tokenriver.runner.native_stack import NativeStack

pytestmark = pytest.mark.skipif(
    load_kernels() is None, reason="native kernels need x86-64 AVX2/FMA/F16C and a C++ compiler"
)
BLOCK_SIZE = 16


def quantized_tiny_model(
    attention_bias: bool, int8_activations: bool = False, intermediate_size: int = 256
) -> LlamaForCausalLM:
    """Three layers with random weights; projections alternate int4 and int8 (per-channel and group-32 scales)."""
    torch.manual_seed(0)
    config = ModelConfig(
        architecture="llama",
        vocab_size=96,
        hidden_size=128,
        intermediate_size=intermediate_size,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        attention_bias=attention_bias,
    )
    return quantize_projections(LlamaForCausalLM(config), int8_activations)


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Random float32 weights: norms around one (Gemma's around zero: it adds one), the rest around zero."""
    model = model.float()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.05)
        for norm in (m for m in model.modules() if type(m).__name__ == "RMSNorm"):
            norm.weight.add_(1.0)
    return model


def quantize_projections(model: torch.nn.Module, int8_activations: bool) -> torch.nn.Module:
    """randomize()'s weights; projections alternate int4 and int8."""
    model = randomize(model)
    options = dict(int8_activations=int8_activations)
    for i, layer in enumerate(model.model.layers):
        attention, mlp = layer.self_attn, layer.mlp
        for owner, name in ((attention, "qkv_proj"), (attention, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
            linear = getattr(owner, name)
            if (i + len(name)) % 2:
                quantized = Int4Linear(quantize_int4(linear.weight), linear.bias, **options)
            else:
                group_size = 32 if i == 1 else None
                quantized = Int8Linear(quantize_int8(linear.weight, group_size), linear.bias, **options)
            setattr(owner, name, quantized)
    return model.eval()


def run_steps(
    model: LlamaForCausalLM,
    requests: list[list[int]],
    steps: list[list[int]],
    native: bool,
    cache_dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Each step feeds steps[s][r] more tokens of request r; returns every step's final hidden states."""
    config = model.config
    num_blocks = [-(-len(ids) // BLOCK_SIZE) for ids in requests]
    tables = [list(range(sum(num_blocks[:r]), sum(num_blocks[: r + 1]))) for r in range(len(requests))]
    cache = KVCache(config.num_layers, sum(num_blocks), BLOCK_SIZE, config.num_kv_heads, config.head_dim, cache_dtype)
    forward = NativeStack(model) if native else model
    done = [0] * len(requests)
    hidden_states = []
    for step in steps:
        active = [r for r, n in enumerate(step) if n]
        ids = [t for r in active for t in requests[r][done[r] : done[r] + step[r]]]
        positions = [p for r in active for p in range(done[r], done[r] + step[r])]
        metadata = AttentionMetadata.build(
            [step[r] for r in active], [done[r] + step[r] for r in active], [tables[r] for r in active], BLOCK_SIZE
        )
        hidden_states.append(forward(torch.tensor(ids), torch.tensor(positions), cache, metadata))
        for r in active:
            done[r] += step[r]
    return hidden_states


def count_native_steps(
    model: LlamaForCausalLM, requests: list[list[int]], steps: list[list[int]], cache_dtype: torch.dtype = torch.float32
) -> int:
    calls = []
    run = NativeDecoder.__call__

    def counting(self, *args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return run(self, *args)

    NativeDecoder.__call__ = counting
    try:
        run_steps(model, requests, steps, native=True, cache_dtype=cache_dtype)
    finally:
        NativeDecoder.__call__ = run
    return len(calls)


# Prompts of 20 / 30 / 40 tokens (the attention kernel's chunk path) beside decodes, then decode steps of 1-3
# requests, and steps of a few tokens per request like speculative verification.
REQUESTS = [[(7 * i + r) % 96 for i in range(80)] for r in range(3)]
STEPS = [[20, 0, 0], [20, 30, 0], [1, 8, 40]] + [[1, 1, 1]] * 4 + [[5, 3, 1], [0, 1, 1], [1, 0, 0], [4, 4, 4]]


@pytest.mark.parametrize("attention_bias", [False, True], ids=["no-bias", "qkv-bias"])
def test_native_decoder_equals_the_module_path_bit_for_bit(attention_bias):
    model = quantized_tiny_model(attention_bias)
    native = run_steps(model, REQUESTS, STEPS, native=True)
    modules = run_steps(model, REQUESTS, STEPS, native=False)
    for step, (ours, reference) in enumerate(zip(native, modules)):
        assert torch.equal(ours, reference), f"step {step}: max difference {(ours - reference).abs().max().item()}"
    # Every step runs natively, the prompt chunks included.
    assert count_native_steps(model, REQUESTS, STEPS) == len(STEPS)


def test_native_decoder_over_a_float16_kv_pool_equals_the_module_path():
    model = quantized_tiny_model(attention_bias=True)
    native = run_steps(model, REQUESTS, STEPS, native=True, cache_dtype=torch.float16)
    modules = run_steps(model, REQUESTS, STEPS, native=False, cache_dtype=torch.float16)
    for ours, reference in zip(native, modules):
        assert torch.equal(ours, reference)
    wide = run_steps(model, REQUESTS, STEPS, native=True)
    assert 0 < max((a - b).abs().max().item() for a, b in zip(native, wide)) < 1e-2
    assert count_native_steps(model, REQUESTS, STEPS, cache_dtype=torch.float16) == len(STEPS)


def test_native_decoder_with_int8_activations_equals_the_module_path():
    model = quantized_tiny_model(attention_bias=False, int8_activations=True)
    for ours, reference in zip(
        run_steps(model, REQUESTS, STEPS, native=True), run_steps(model, REQUESTS, STEPS, native=False)
    ):
        assert torch.equal(ours, reference)


def test_native_decoder_runs_gemm_sized_batches():
    """16 requests decoding at once: every projection takes the GEMM (more than max_gemv_rows rows)."""
    model = quantized_tiny_model(attention_bias=True)
    requests = [[(5 * i + 3 * r) % 96 for i in range(12)] for r in range(16)]
    steps = [[8] * 16, [1] * 16, [1] * 16, [2] * 16]
    for ours, reference in zip(
        run_steps(model, requests, steps, native=True), run_steps(model, requests, steps, native=False)
    ):
        assert torch.equal(ours, reference)


@pytest.mark.parametrize("intermediate_size", [256, 192, 224])
def test_native_decoder_rounded_gemm_batches_equal_the_module_path(intermediate_size):
    """21 requests decoding with int8 activations: on a CPU with AVX512-VNNI the MLP keeps its intermediate
    feature-major (decoder.cpp), with a partial panel of 5 rows, and SwiGLU runs in the gate/up product's tiles of
    three gates and their ups (intermediate sizes leaving 1, 0 and 2 gates for the last tile); the same bits as the
    modules' row-major products and SwiGLU."""
    model = quantized_tiny_model(attention_bias=False, int8_activations=True, intermediate_size=intermediate_size)
    requests = [[(5 * i + 3 * r) % 96 for i in range(14)] for r in range(21)]
    steps = [[8] * 21, [1] * 21, [1] * 21, [3] * 21, [1] * 21]
    for ours, reference in zip(
        run_steps(model, requests, steps, native=True), run_steps(model, requests, steps, native=False)
    ):
        assert torch.equal(ours, reference)


@pytest.mark.parametrize("int8_activations", [False, True], ids=["exact", "int8-activations"])
def test_row_groups_per_thread_give_the_same_bits_as_split_operations(int8_activations):
    """Decode steps of 25 requests on two threads, each thread running 12 or 13 of the rows through the whole stack
    (decoder.cpp's row groups), against every operation split across the threads and against the modules. Prompt
    steps, steps of two query tokens per request (the second attends to the key the first writes, which the other
    group would write: once cut there, a row read it before it was written) and a decode step of 20 rows (10 per
    thread: the GEMV's size) are not cut into groups and must agree as well."""
    model = quantized_tiny_model(attention_bias=True, int8_activations=int8_activations)
    requests = [[(5 * i + 3 * r) % 96 for i in range(14)] for r in range(25)]
    steps = [[8] * 25, [1] * 25, [1] * 25, [2] * 25, [1] * 20 + [0] * 5, [1] * 25]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = {}
        for threading in ("row_groups", "split", "auto"):
            NativeDecoder.threading = threading
            runs[threading] = run_steps(model, requests, steps, native=True)
    finally:
        NativeDecoder.threading = "auto"
        torch.set_num_threads(threads)
    modules = run_steps(model, requests, steps, native=False)
    for step, reference in enumerate(modules):
        for threading, hidden_states in runs.items():
            assert torch.equal(hidden_states[step], reference), f"{threading}, step {step}"


def test_an_unknown_threading_is_refused_with_the_choices():
    model = quantized_tiny_model(attention_bias=False)
    NativeDecoder.threading = "rows"
    try:
        with pytest.raises(ValueError, match="one of .*'auto'.*got 'rows'"):
            run_steps(model, REQUESTS, STEPS[:1], native=True)
    finally:
        NativeDecoder.threading = "auto"


def test_native_decoder_slices_long_steps_without_changing_a_bit():
    """Steps of more than 256 rows run the stack over 256-row slices (decoder.cpp): prompt chunks cut at a slice
    edge, decode tokens in either slice, int8 activations on the bfloat16/int8 GEMM where the CPU has one."""
    requests = [[(7 * i + 3 * r) % 96 for i in range(701)] for r in range(4)]
    steps = [[300, 250, 0, 0], [1, 1, 400, 200], [1, 449, 1, 1], [1, 0, 299, 499], [1, 1, 0, 0]]
    for int8_activations in (False, True):
        model = quantized_tiny_model(attention_bias=True, int8_activations=int8_activations)
        native = run_steps(model, requests, steps, native=True)
        modules = run_steps(model, requests, steps, native=False)
        for step, (ours, reference) in enumerate(zip(native, modules)):
            assert torch.equal(ours, reference), f"step {step}: max difference {(ours - reference).abs().max()}"
        assert count_native_steps(model, requests, steps) == len(steps)


def test_float_layers_stay_on_the_module_path():
    model = quantized_tiny_model(attention_bias=False)
    model.model.layers[1].mlp.down_proj = torch.nn.Linear(256, 128, bias=False)
    assert NativeDecoder.build(model.model.layers) is None


def test_moving_the_model_rebinds_the_weights():
    model = quantized_tiny_model(attention_bias=False)
    stack = NativeStack(model)
    cache = KVCache(3, 1, BLOCK_SIZE, 2, 32, torch.float32)
    stack(torch.tensor([1]), torch.tensor([0]), cache, AttentionMetadata.build([1], [1], [[0]], BLOCK_SIZE))
    bound = stack.native
    model._apply(torch.clone)  # every weight to a new address, as .to() to another device or dtype does
    stack(torch.tensor([2]), torch.tensor([1]), cache, AttentionMetadata.build([1], [2], [[0]], BLOCK_SIZE))
    assert bound is not None and stack.native is not None and stack.native is not bound


def test_the_binding_does_not_keep_a_dropped_kv_cache_alive():
    model = quantized_tiny_model(attention_bias=False)
    stack = NativeStack(model)
    cache = KVCache(3, 1, BLOCK_SIZE, 2, 32, torch.float32)
    stack(torch.tensor([1]), torch.tensor([0]), cache, AttentionMetadata.build([1], [1], [[0]], BLOCK_SIZE))
    assert stack.native is not None
    dropped = weakref.ref(cache)
    del cache
    gc.collect()
    assert dropped() is None


def test_a_self_draft_binds_its_own_shorter_layer_list():
    """first_layers copies a model that has already run: the copy must not run the target's 3 layers."""
    model = quantized_tiny_model(attention_bias=False)
    target = NativeStack(model)
    target(
        torch.tensor([1, 2]),
        torch.tensor([0, 1]),
        KVCache(3, 1, BLOCK_SIZE, 2, 32, torch.float32),
        AttentionMetadata.build([2], [2], [[0]], BLOCK_SIZE),
    )
    draft = first_layers(model, 2)
    stack = NativeStack(draft)
    cache = KVCache(2, 1, BLOCK_SIZE, 2, 32, torch.float32)
    stack(torch.tensor([1, 2]), torch.tensor([0, 1]), cache, AttentionMetadata.build([2], [2], [[0]], BLOCK_SIZE))
    assert stack.native is not None and len(draft.model.layers) == 2
    assert stack.native is not target.native and len(model.model.layers) == 3


def test_a_model_of_another_layout_runs_its_own_forward():
    model = quantized_tiny_model(attention_bias=False)
    model.layer_layout = "other"
    stack = NativeStack(model)
    cache = KVCache(3, 1, BLOCK_SIZE, 2, 32, torch.float32)
    calls = []
    run = NativeDecoder.__call__
    NativeDecoder.__call__ = lambda self, *args: calls.append(1) or run(self, *args)
    try:
        stack(torch.tensor([1]), torch.tensor([0]), cache, AttentionMetadata.build([1], [1], [[0]], BLOCK_SIZE))
    finally:
        NativeDecoder.__call__ = run
    assert calls == [] and stack.native is None


def test_out_of_range_block_ids_raise_through_the_native_call():
    model = quantized_tiny_model(attention_bias=False)
    config = model.config
    cache = KVCache(config.num_layers, 2, BLOCK_SIZE, config.num_kv_heads, config.head_dim, torch.float32)
    metadata = AttentionMetadata.build([1], [1], [[5]], BLOCK_SIZE)  # block 5 of a 2-block pool
    with pytest.raises(IndexError, match="out of range"):
        NativeStack(model)(torch.tensor([3]), torch.tensor([0]), cache, metadata)


def test_the_embedded_model_decodes_natively_with_equal_results(loaded_packed):
    model = loaded_packed.model
    requests = [
        loaded_packed.tokenizer.encode(text)
        for text in (
            "The river carries every token downstream, one at a time, toward the sea.",
            "Paged attention keeps each request's keys and values in blocks of sixteen tokens.",
        )
    ]
    steps = [[6, 6]] + [[1, 1]] * 3 + [[3, 0]]  # each text is over 12 tokens
    native = run_steps(model, requests, steps, native=True)
    assert NativeDecoder.build(model.model.layers) is not None
    for ours, reference in zip(native, run_steps(model, requests, steps, native=False)):
        assert torch.equal(ours, reference)


# Sliding layers see their last 8 positions: far fewer than the 80-token requests.
WINDOW = 8
FAMILIES = ["qwen3", "phi3", "gemma3", "gemma2"]


def family_tiny_model(family: str, int8_activations: bool = False) -> torch.nn.Module:
    """Four layers of Qwen3, Phi-4-mini-style Phi-3, Gemma 3 or Gemma 2 with q/k norms (Qwen3, Gemma 3) and
    sliding layers (0 and 2) of window 8; Phi-3 rotates part of each head with LongRoPE factors; Gemma 3's sliding
    layers turn with their own rope base, its global ones with linear scaling; Gemma 2 soft-caps. Weights as
    quantized_tiny_model's."""
    torch.manual_seed(0)
    sizes = dict(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        sliding_window=WINDOW,
        layer_types=("sliding_attention", "full_attention") * 2,
    )
    if family == "qwen3":
        model = Qwen3ForCausalLM(ModelConfig(architecture="qwen3", qk_norm=True, **sizes))
    elif family == "phi3":
        # Phi-4-mini's partial rotary (24 of 32 values turn) and LongRoPE, whose long factors start at position 40.
        longrope = {
            "rope_type": "longrope",
            "short_factor": [1.0 + i / 12 for i in range(12)],
            "long_factor": [2.0 + i / 6 for i in range(12)],
            "original_max_position_embeddings": 40,
        }
        model = Phi3ForCausalLM(
            ModelConfig(architecture="phi3", partial_rotary_factor=0.75, rope_scaling=longrope, **sizes)
        )
    else:
        gemma = dict(hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=24, tie_word_embeddings=True)
        if family == "gemma3":
            gemma.update(qk_norm=True, rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
        else:
            gemma.update(attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
        model = GemmaForCausalLM(ModelConfig(architecture=family, **gemma, **sizes))
    return quantize_projections(model, int8_activations)


def assert_native_equals_modules(model: torch.nn.Module, requests: list[list[int]], steps: list[list[int]]) -> None:
    native = run_steps(model, requests, steps, native=True)
    modules = run_steps(model, requests, steps, native=False)
    for step, (ours, reference) in enumerate(zip(native, modules)):
        assert torch.equal(ours, reference), f"step {step}: max difference {(ours - reference).abs().max().item()}"
    assert count_native_steps(model, requests, steps) == len(steps)


@pytest.mark.parametrize("int8_activations", [False, True], ids=["exact", "int8-activations"])
@pytest.mark.parametrize("family", FAMILIES)
def test_families_run_natively_with_the_module_paths_bits(family, int8_activations):
    """Prompt chunks, decode steps and multi-token steps, past the sliding window."""
    model = family_tiny_model(family, int8_activations)
    stack = NativeStack(model)
    cache = KVCache(4, 1, BLOCK_SIZE, 2, 32, torch.float32)
    stack(torch.tensor([1]), torch.tensor([0]), cache, AttentionMetadata.build([1], [1], [[0]], BLOCK_SIZE))
    assert stack.native is not None
    assert_native_equals_modules(model, REQUESTS, STEPS)


@pytest.mark.parametrize("family", FAMILIES)
def test_families_over_an_int8_kv_pool_equal_the_module_path(family):
    model = family_tiny_model(family)
    for ours, reference in zip(
        run_steps(model, REQUESTS, STEPS, native=True, cache_dtype=torch.int8),
        run_steps(model, REQUESTS, STEPS, native=False, cache_dtype=torch.int8),
    ):
        assert torch.equal(ours, reference)


@pytest.mark.parametrize("int8_activations", [False, True], ids=["exact", "int8-activations"])
@pytest.mark.parametrize("family", FAMILIES)
def test_families_run_gemm_sized_batches(family, int8_activations):
    """21 requests decoding: every projection takes the GEMM; with int8 activations on AVX512-VNNI, Qwen3's MLP
    takes the fused SwiGLU GEMM and Gemma's MLP the fused GeGLU one."""
    model = family_tiny_model(family, int8_activations)
    requests = [[(5 * i + 3 * r) % 96 for i in range(14)] for r in range(21)]
    assert_native_equals_modules(model, requests, [[8] * 21, [1] * 21, [1] * 21, [3] * 21, [1] * 21])


@pytest.mark.parametrize("family", FAMILIES)
def test_families_in_row_groups_and_long_steps_keep_their_bits(family):
    """Row groups per thread and 256-row slices cut the step's tables, the local rope's too."""
    model = family_tiny_model(family)
    requests = [[(5 * i + 3 * r) % 96 for i in range(14)] for r in range(25)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    NativeDecoder.threading = "row_groups"
    try:
        assert_native_equals_modules(model, requests, [[8] * 25, [1] * 25, [1] * 25])
    finally:
        NativeDecoder.threading = "auto"
        torch.set_num_threads(threads)
    requests = [[(7 * i + 3 * r) % 96 for i in range(320)] for r in range(2)]
    assert_native_equals_modules(model, requests, [[300, 0], [1, 270], [1, 1]])


MOE_FAMILIES = {
    "qwen3_moe": dict(qk_norm=True),
    "qwen2_moe": dict(attention_bias=True, norm_topk_prob=False, shared_expert_intermediate_size=96),
    "mixtral": dict(),
}


def moe_tiny_model(family: str, int8_activations: bool = False) -> torch.nn.Module:
    """Two layers of eight experts, two per token (Qwen2-MoE with a gated shared expert), every projection
    quantized (int4 and int8 alternating) and the router and shared gate float, as the loader keeps them."""
    torch.manual_seed(0)
    config = ModelConfig(
        architecture=family,
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        **MOE_FAMILIES[family],
    )
    model = randomize(model_class(family)(config))
    options = dict(int8_activations=int8_activations)
    owners = [(layer.self_attn, name) for layer in model.model.layers for name in ("qkv_proj", "o_proj")]
    for layer in model.model.layers:
        mlps = [*layer.mlp.experts] + ([layer.mlp.shared_expert] if layer.mlp.shared_expert is not None else [])
        owners += [(mlp, name) for mlp in mlps for name in ("gate_up_proj", "down_proj")]
    for i, (owner, name) in enumerate(owners):
        linear = getattr(owner, name)
        quantized = (
            Int4Linear(quantize_int4(linear.weight), linear.bias, **options)
            if i % 2
            else Int8Linear(quantize_int8(linear.weight, 32), linear.bias, **options)
        )
        setattr(owner, name, quantized)
    return model.eval()


@pytest.mark.parametrize("int8_activations", [False, True], ids=["exact", "int8-activations"])
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_mixtures_of_experts_run_natively_with_the_module_paths_bits(family, int8_activations):
    """Prompt chunks, decodes and multi-token steps; then 21 decoding requests, so that some experts get enough
    rows for the GEMM."""
    model = moe_tiny_model(family, int8_activations)
    assert NativeDecoder.build(model.model.layers) is not None
    assert_native_equals_modules(model, REQUESTS, STEPS)
    requests = [[(5 * i + 3 * r) % 96 for i in range(14)] for r in range(21)]
    assert_native_equals_modules(model, requests, [[8] * 21, [1] * 21, [1] * 21, [3] * 21])


def test_a_mixture_of_experts_with_a_quantized_router_stays_on_the_module_path():
    model = moe_tiny_model("qwen3_moe")
    layer = model.model.layers[1]
    layer.mlp.gate = Int8Linear(quantize_int8(layer.mlp.gate.weight, 32))
    assert NativeDecoder.build(model.model.layers) is None


# Per mix: the kinds of q/k/v, o, gate/up, and layer 1's q/k/v stacked of two kinds (as a Q4_K_M file stacks Q4_K
# q and k beside a Q6_K v, a Q3_K_M file Q3_K beside Q5_K).
KQUANT_MIXES = {
    "Q4_K_M": (("Q4_K", "Q5_K", "Q4_K"), ("Q4_K", "Q6_K")),
    "Q3_K_M": (("Q3_K", "Q2_K", "Q3_K"), ("Q3_K", "Q5_K")),
}


def kquant_tiny_model(
    down_kind: str = "Q6_K", mix: str = "Q4_K_M", family: str = "llama", stacked: bool = False
) -> torch.nn.Module:
    """Two layers of Llama (or Gemma 3: GeGLU) whose projections are K-quant weights at their own size
    (models/kquant.py), in one of KQUANT_MIXES; int8 activations, the engine's default. The second layer's qkv_proj
    has parts of two types: in the union of their layouts, or stacked (models/stacked.py: the loader's choice), and
    then its gate_up_proj too."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/models: kquant_weights
    from kquant_weights import random_kquant

    sizes = dict(
        vocab_size=96, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64
    )
    if family == "gemma3":
        gemma = dict(hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=64, tie_word_embeddings=True, qk_norm=True)
        model = randomize(GemmaForCausalLM(ModelConfig(architecture="gemma3", **gemma, **sizes)))
    else:
        model = randomize(LlamaForCausalLM(ModelConfig(architecture="llama", **sizes)))
    (qkv_kind, o_kind, gate_up_kind), (stacked_kind, v_kind) = KQUANT_MIXES[mix]
    kinds = {"qkv_proj": qkv_kind, "o_proj": o_kind, "gate_up_proj": gate_up_kind, "down_proj": down_kind}
    for i, layer in enumerate(model.model.layers):
        for owner, name in (
            (layer.self_attn, "qkv_proj"),
            (layer.self_attn, "o_proj"),
            (layer.mlp, "gate_up_proj"),
            (layer.mlp, "down_proj"),
        ):
            rows, cols = getattr(owner, name).weight.shape
            split = 64 if name == "qkv_proj" else rows // 2
            parts = [random_kquant(rows - split, cols, stacked_kind, i), random_kquant(split, cols, v_kind, i)]
            if i == 1 and stacked and name in ("qkv_proj", "gate_up_proj"):
                setattr(owner, name, StackedLinear(KQuantStack(tuple(pack_records(part) for part in parts))))
                continue
            if name == "qkv_proj" and i == 1:
                weight = concatenate_kquant(parts)
            else:
                weight = random_kquant(rows, cols, kinds[name], seed=10 * i + len(name))
            setattr(owner, name, KQuantLinear(weight, int8_activations=True))
    for module in model.modules():
        if isinstance(module, KQuantLinear):
            module.set_int8_activations(True)
    return model.eval()


@pytest.mark.skipif(load_kernels() is None or not load_kernels().kquant, reason="K-quant kernels need AVX512-VNNI")
@pytest.mark.parametrize(
    ("down_kind", "mix", "family", "stacked"),
    [
        ("Q6_K", "Q4_K_M", "llama", False),
        ("Q5_K", "Q4_K_M", "llama", False),
        ("Q2_K", "Q3_K_M", "llama", False),
        ("Q6_K", "Q3_K_M", "gemma3", False),
        ("Q6_K", "Q4_K_M", "llama", True),
        ("Q6_K", "Q3_K_M", "gemma3", True),
    ],
)
def test_k_quant_layers_run_natively_with_the_module_paths_bits(down_kind, mix, family, stacked):
    """The MLP's prompt steps and GEMM-sized decode steps take the feature-major products (decoder.cpp's
    mlp_feature_major) whatever the K types: SwiGLU (Gemma 3: GeGLU) in the gate/up product's tiles, Q4_K's int4
    tiles or the halves' products of Q6_K, Q3_K and Q2_K (over their 2-bit codes), and a down product packing its
    input from the feature-major intermediate; the modules run them row-major, with a pass of SwiGLU between."""
    model = kquant_tiny_model(down_kind, mix, family, stacked)
    for ours, reference in zip(
        run_steps(model, REQUESTS, STEPS, native=True), run_steps(model, REQUESTS, STEPS, native=False)
    ):
        assert torch.equal(ours, reference)
    assert count_native_steps(model, REQUESTS, STEPS) == len(STEPS)
    requests = [[(5 * i + 3 * r) % 96 for i in range(12)] for r in range(16)]  # GEMM-sized decode batches
    steps = [[8] * 16, [1] * 16, [2] * 16]
    for ours, reference in zip(
        run_steps(model, requests, steps, native=True), run_steps(model, requests, steps, native=False)
    ):
        assert torch.equal(ours, reference)
