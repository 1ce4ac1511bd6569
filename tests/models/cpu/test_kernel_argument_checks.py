"""Every native entry point (models/cpu/kernels.py's wrappers, the decoder stack's binding in models/cpu/decoder.py)
refuses a call whose tensors do not hold what the kernel would read, with a ValueError naming the argument, instead
of letting the C++ read past a buffer.

Each case makes one argument wrong (a buffer too small, a dtype, a layout, a size that disagrees with another
argument) and calls the entry point. A missing check would crash the process, or pass silently, so the cases run
in forked children of one interpreter (this file run as a script): a crash is reported with its signal and the
case's name, the rest still run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenriver.kv.cache import KVCache
from tokenriver.models.attention_metadata import AttentionMetadata
from tokenriver.models.cpu import tiles
from tokenriver.models.cpu.decoder import NativeDecoder
from tokenriver.models.cpu.kernels import load_kernels
from tokenriver.models.kquant import KQuantRecords

pytestmark = pytest.mark.skipif(
    load_kernels() is None, reason="native kernels need x86-64 AVX2/FMA/F16C and a C++ compiler"
)
# A case finishes in milliseconds; one still running after this is hung.
CASE_TIMEOUT_S = 60
ROWS, COLS, GROUP = 32, 128, 32
# name → (the call, words its error must contain)
CASES: dict[str, tuple[Callable[[], object], str]] = {}


def case(words: str) -> Callable[[Callable[[], object]], Callable[[], object]]:
    """Register the decorated function as a case whose error must contain `words`."""

    def register(function: Callable[[], object]) -> Callable[[], object]:
        CASES[function.__name__] = (function, words)
        return function

    return register


def kernels():
    return load_kernels()


def int4_tiles(rows: int = ROWS, cols: int = COLS, group_size: int = GROUP) -> tiles.Tiles:
    generator = torch.Generator().manual_seed(0)
    qweight = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator)  # [N, K / 2]
    scales = torch.rand(rows, cols // group_size, generator=generator).half()  # [N, K / G]
    return tiles.tile(qweight, scales, scales.clone(), None, group_size)


def int8_tiles(rows: int = ROWS, cols: int = COLS) -> tiles.Tiles:
    generator = torch.Generator().manual_seed(0)
    qweight = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=generator)  # [N, K]
    scales = torch.rand(rows, cols // GROUP, generator=generator).half()  # [N, K / 32]
    return tiles.tile(qweight, scales, None, None, GROUP)


# --- products and lookups of weights in row tiles (gemv.cpp, gemm.cpp) --------------------------------------------


@case("codes")
def bind_codes_too_small():
    tiled = int4_tiles()
    return kernels().bind(dataclasses.replace(tiled, codes=tiled.codes[:1]))


@case("scales")
def bind_scales_too_small():
    tiled = int8_tiles()
    return kernels().bind(dataclasses.replace(tiled, scales=tiled.scales[:, :1]))


@case("mins")
def bind_int4_mins_too_small():
    return kernels().bind(dataclasses.replace(int4_tiles(), mins=torch.zeros(1, dtype=torch.float16)))


@case("fifth bits")
def bind_fifth_bits_too_small():
    return kernels().bind(dataclasses.replace(int4_tiles(), fifth=torch.zeros(1, dtype=torch.int64)))


@case("codes")
def bind_more_rows_than_tiles():
    tiled = int4_tiles()
    return kernels().bind(dataclasses.replace(tiled, rows=ROWS + 1))


@case("multiples of 32")
def bind_group_not_whole_blocks():
    return kernels().bind(dataclasses.replace(int8_tiles(), group_size=48))


@case("chain_ends")
def bind_chain_ends_past_the_row():
    ends = torch.tensor([2, COLS // 32 + 3], dtype=torch.int64)
    return kernels().bind(dataclasses.replace(int8_tiles(), chain_ends=ends), rounding="int8")


# --- K-quant weights at their own size (kquant.cpp, gemm.cpp) -------------------------------------------------------


def kquant_tiles(rows: int = ROWS, cols: int = 256) -> tiles.KTiles:
    """Q6_K-shaped tile records (bits 4 and 5, scales per 16, centred rows), random bytes."""
    from tokenriver.models.kquant import RecordLayout

    layout = RecordLayout(num_high=2, scale_group=16, has_mins=False)
    records = torch.randint(0, 256, (rows, cols // 256, layout.size), dtype=torch.uint8)
    offsets = torch.full((rows,), 32, dtype=torch.uint8)
    return tiles.tile_kquant(KQuantRecords(records, offsets, layout), in_place=False)


@case("records")
def bind_kquant_records_too_small():
    tiled = kquant_tiles()
    return kernels().bind_kquant(dataclasses.replace(tiled, records=tiled.records[:1]), many_rows=False)


@case("records")
def bind_kquant_more_rows_than_tiles():
    return kernels().bind_kquant(dataclasses.replace(kquant_tiles(), rows=ROWS + 1), many_rows=True)


@case("multiple of 256")
def bind_kquant_columns_not_super_blocks():
    return kernels().bind_kquant(dataclasses.replace(kquant_tiles(), cols=300), many_rows=False)


@case("chain_ends")
def bind_kquant_chain_ends_past_the_row():
    ends = torch.tensor([2, 256 // 32 + 3], dtype=torch.int64)
    return kernels().bind_kquant(dataclasses.replace(kquant_tiles(), chain_ends=ends), many_rows=False)


@case("x must be")
def kquant_linear_x_narrower_than_the_weight():
    return kernels().bind_kquant(kquant_tiles(), many_rows=False)(torch.zeros(2, 128))


@case("row_ids")
def kquant_dequantize_rows_of_int32_ids():
    return kernels().kquant_dequantize_rows(kquant_tiles(), torch.tensor([0, 1], dtype=torch.int32))


@case("blocks must be")
def convert_kquant_rows_of_the_wrong_length():
    from tokenriver.models.kquant import RecordLayout

    layout = RecordLayout(num_high=2, scale_group=16, has_mins=False)
    return kernels().convert_kquant(np.zeros((4, 209), dtype=np.uint8), 14, 256, layout, 1, torch.empty)


@case("rows")
def tile_kquant_in_place_of_partial_tiles():
    from tokenriver.models.kquant import RecordLayout

    layout = RecordLayout(num_high=2, scale_group=16, has_mins=False)
    return kernels().tile_kquant_in_place(torch.zeros(17, 1, layout.size, dtype=torch.uint8), layout, 1)


@case("x must be")
def linear_x_narrower_than_the_weight():
    return kernels().bind(int4_tiles())(torch.zeros(3, COLS // 2))


@case("x must be")
def linear_x_not_contiguous():
    return kernels().bind(int8_tiles(), many_rows=True)(torch.zeros(4, 2 * COLS)[:, ::2])


@case("x must be")
def linear_x_of_doubles():
    return kernels().bind(int4_tiles())(torch.zeros(1, COLS, dtype=torch.float64))


@case("codes")
def dequantize_rows_of_small_tiles():
    tiled = int8_tiles()
    return kernels().dequantize_rows(dataclasses.replace(tiled, codes=tiled.codes[:1]), torch.tensor([0, 1]))


@case("row_ids")
def dequantize_rows_of_int32_ids():
    return kernels().dequantize_rows(int4_tiles(), torch.tensor([0, 1], dtype=torch.int32))


@case("row_ids")
def dequantize_rows_of_a_matrix_of_ids():
    return kernels().dequantize_rows(int4_tiles(), torch.zeros(2, 2, dtype=torch.int64))


# --- row-major packings (gemm.cpp's dequantize) and conversions (convert.cpp) ----------------------------------------


@case("scales")
def int4_dequantize_scales_too_small():
    qweight = torch.zeros(ROWS, COLS // 2, dtype=torch.uint8)
    scales = torch.zeros(ROWS, 1, dtype=torch.float16)
    mins = torch.zeros(ROWS, COLS // GROUP, dtype=torch.float16)
    return kernels().int4_dequantize(qweight, scales, mins, GROUP)


@case("high_bits")
def int4_dequantize_high_bits_too_small():
    qweight = torch.zeros(ROWS, COLS // 2, dtype=torch.uint8)
    scales = torch.zeros(ROWS, COLS // GROUP, dtype=torch.float16)
    high_bits = torch.zeros(ROWS - 1, COLS // 32, dtype=torch.int32)
    return kernels().int4_dequantize(qweight, scales, scales.clone(), GROUP, high_bits)


@case("multiples of 32")
def int8_dequantize_group_larger_than_the_row():
    qweight = torch.zeros(ROWS, COLS, dtype=torch.int8)
    return kernels().int8_dequantize(qweight, torch.zeros(ROWS, 1, dtype=torch.float16), 2 * COLS)


@case("qweight")
def int8_dequantize_codes_of_bytes():
    qweight = torch.zeros(ROWS, COLS, dtype=torch.uint8)
    return kernels().int8_dequantize(qweight, torch.zeros(ROWS, COLS // GROUP, dtype=torch.float16), GROUP)


@case("blocks must be")
def convert_to_int8_rows_short_of_their_blocks():
    blocks = np.zeros((ROWS, COLS // 32 * 34 - 1), dtype=np.uint8)  # Q8_0: 34 bytes per 32
    return kernels().convert_to_int8(blocks, 8, COLS, 1)


@case("not one it converts")
def convert_to_int8_of_a_type_it_does_not_take():
    return kernels().convert_to_int8(np.zeros((ROWS, COLS // 256 * 144), dtype=np.uint8), 12, 256, 1)


@case("blocks must be")
def convert_q4_k_blocks_not_contiguous():
    blocks = np.zeros((ROWS, 2 * 144), dtype=np.uint8)[:, ::2]
    return kernels().convert_q4_k(blocks, 256, 1)


@case("whole blocks")
def convert_q4_k_columns_not_whole_blocks():
    return kernels().convert_q4_k(np.zeros((ROWS, 144), dtype=np.uint8), 128, 1)


@case("allocated")
def convert_q5_k_into_a_small_allocation():
    def empty(shape, dtype):
        return torch.empty(1, dtype=dtype)

    return kernels().convert_five_bit(np.zeros((ROWS, 176), dtype=np.uint8), 13, 256, 1, empty)


@case("blocks must be")
def convert_q5_0_rows_of_a_partial_block():
    return kernels().convert_five_bit(np.zeros((ROWS, 30), dtype=np.uint8), 6, 32, 1)


@case("whole tiles")
def tile_rows_in_place_of_a_partial_tile():
    return kernels().tile_rows_in_place(torch.zeros(ROWS + 3, 8, dtype=torch.int32), 1)


@case("contiguous")
def tile_rows_in_place_of_a_strided_view():
    return kernels().tile_rows_in_place(torch.zeros(16, 16, dtype=torch.int32)[:, ::2], 1)


@case("int32")
def tile_fifth_bits_in_place_of_wider_words():
    return kernels().tile_fifth_bits_in_place(torch.zeros(16, 4, dtype=torch.int64), 1)


@case("K a multiple of 32")
def quantize_int8_groups_of_a_partial_group():
    return kernels().quantize_int8_groups(torch.zeros(ROWS, 40), 1)


# --- a layer's small ops (ops.cpp) -----------------------------------------------------------------------------


@case("weight")
def rms_norm_weight_narrower_than_x():
    return kernels().rms_norm(torch.ones(4, 64), torch.ones(32), 1e-6)


@case("residual")
def rms_norm_residual_of_fewer_rows():
    return kernels().rms_norm(torch.ones(4, 64), torch.ones(64), 1e-6, residual=torch.zeros(2, 64))


@case("x must be")
def rms_norm_x_not_contiguous():
    return kernels().rms_norm(torch.ones(64, 4).t(), torch.ones(64), 1e-6)


@case("cos")
def rotary_tables_of_fewer_tokens():
    query, key = torch.zeros(3, 4, 32), torch.zeros(3, 2, 32)
    return kernels().rotary_(query, key, torch.ones(2, 16), torch.zeros(2, 16))


@case("same tokens")
def rotary_key_of_other_tokens():
    query, key = torch.zeros(3, 4, 32), torch.zeros(2, 2, 32)
    return kernels().rotary_(query, key, torch.ones(3, 16), torch.zeros(3, 16))


@case("query")
def rotary_query_of_doubles():
    query, key = torch.zeros(3, 4, 32, dtype=torch.float64), torch.zeros(3, 2, 32)
    return kernels().rotary_(query, key, torch.ones(3, 16), torch.zeros(3, 16))


@case("gate_up")
def silu_mul_of_an_odd_width():
    return kernels().silu_mul(torch.zeros(2, 7))


@case("gate_up")
def gelu_tanh_mul_not_contiguous():
    return kernels().gelu_tanh_mul(torch.zeros(8, 4).t())


@case("weight")
def row_dots_weight_narrower_than_x():
    return kernels().row_dots(torch.zeros(2, 64), torch.zeros(8, 32))


@case("logits")
def moe_route_logits_not_contiguous():
    return kernels().moe_route(torch.zeros(8, 4).t(), 2, True)


@case("top_k")
def moe_route_more_picks_than_experts():
    return kernels().moe_route(torch.zeros(2, 4), 5, True)


@case("weight")
def sigmoid_gate_weight_narrower_than_x():
    return kernels().sigmoid_gate(torch.zeros(2, 64), torch.zeros(32))


# --- paged attention (attention.cpp) -------------------------------------------------------------------------------


def attention_call(**changes: object) -> None:
    """A valid two-token decode of one request with `changes` applied to the arguments."""
    num_tokens, heads, kv_heads, head_dim = 2, 4, 2, 32
    arguments = dict(
        query=torch.zeros(num_tokens, heads, head_dim),
        key=torch.zeros(num_tokens, kv_heads, head_dim),
        value=torch.zeros(num_tokens, kv_heads, head_dim),
        slot_mapping=torch.tensor([0, 1]),
        key_cache=torch.zeros(4, 16, kv_heads, head_dim),
        value_cache=torch.zeros(4, 16, kv_heads, head_dim),
        block_tables=torch.zeros(1, 4, dtype=torch.int64),
        queries=torch.tensor([[0, 0, 1], [1, 0, 2]]),
        chunks=None,
        scale=head_dim**-0.5,
        out=torch.zeros(num_tokens, heads, head_dim),
    )
    kernels().paged_attention(**(arguments | changes))


@case("out")
def paged_attention_out_of_fewer_heads():
    attention_call(out=torch.zeros(2, 2, 32))


@case("key")
def paged_attention_key_of_a_smaller_head():
    attention_call(key=torch.zeros(2, 2, 16))


@case("pools")
def paged_attention_value_pool_smaller_than_the_keys():
    attention_call(value_cache=torch.zeros(2, 16, 2, 32))


@case("key/value heads")
def paged_attention_pools_of_no_heads():
    attention_call(key_cache=torch.zeros(4, 16, 0, 32), value_cache=torch.zeros(4, 16, 0, 32))


@case("queries [n, 3]")
def paged_attention_queries_of_two_columns():
    attention_call(queries=torch.tensor([[0, 0], [1, 0]]))


@case("out of range")
def paged_attention_slot_past_the_pool():
    attention_call(slot_mapping=torch.tensor([0, 4 * 16]))


# --- the decoder stack's binding (decoder.py) ------------------------------------------------------------------------


def native_step(**changes: object) -> tuple[NativeDecoder, dict]:
    """The tiny quantized Llama of test_native_decoder.py bound natively, and a valid one-token decode step of it with
    `changes` applied (hidden, rope, kv_cache, metadata)."""
    from test_native_decoder import quantized_tiny_model

    model = quantized_tiny_model(attention_bias=False)
    config = model.config
    native = NativeDecoder.build(model.model.layers)
    assert native is not None
    hidden, rope = model.model.embed(torch.tensor([3]), torch.tensor([4]))
    step = dict(
        hidden=hidden,
        rope=rope,
        kv_cache=KVCache(config.num_layers, 4, 16, config.num_kv_heads, config.head_dim, torch.float32),
        metadata=AttentionMetadata.build([1], [5], [[0]], 16),
    )
    return native, step | changes


def run_native_step(**changes: object) -> None:
    with torch.inference_mode():
        native, step = native_step(**changes)
        native(**step)


@case("hidden must be")
def decoder_hidden_narrower_than_the_stack():
    run_native_step(hidden=torch.zeros(1, 64))


@case("rope tables")
def decoder_rope_tables_of_fewer_tokens():
    with torch.inference_mode():
        native, step = native_step()
        cos, sin = step["rope"]
        native(step["hidden"].repeat(2, 1), (cos, sin), step["kv_cache"], step["metadata"])


@case("layer 2's pools")
def decoder_cache_with_a_smaller_layer():
    with torch.inference_mode():
        native, step = native_step()
        cache = step["kv_cache"]
        key, value = cache.layers[2]
        cache.layers[2] = (key[:, :, :1].contiguous(), value[:, :, :1].contiguous())
        native(**step)


@case("attention metadata")
def decoder_queries_of_two_columns():
    with torch.inference_mode():
        native, step = native_step()
        metadata = dataclasses.replace(step["metadata"], kernel_queries=torch.tensor([[0, 0]]))
        native(step["hidden"], step["rope"], step["kv_cache"], metadata)


@case("out of range")
def decoder_block_id_past_the_pool():
    with torch.inference_mode():
        native, step = native_step()
        metadata = step["metadata"]
        metadata.block_tables.fill_(99)
        native(**step)


@case("input_norm")
def decoder_build_with_a_narrow_norm():
    from test_native_decoder import quantized_tiny_model

    model = quantized_tiny_model(attention_bias=False)
    norm = model.model.layers[1].input_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach()[:64].clone(), requires_grad=False)
    NativeDecoder.build(model.model.layers)


# --- running the cases ------------------------------------------------------------------------------------------


def run_case(name: str) -> dict:
    """The case in a forked child: what it raised (or that it returned), its signal, or that it hung."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        torch.set_num_threads(1)
        try:
            CASES[name][0]()
            report = {"outcome": "returned"}
        except Exception as error:  # what the test looks at: the type and message of whatever came out
            report = {"outcome": "raised", "type": type(error).__name__, "message": str(error)[:2000]}
        os.write(write_end, json.dumps(report).encode())
        os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + CASE_TIMEOUT_S
    while True:
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_end)
            return {"outcome": "hung"}
        time.sleep(0.005)
    with os.fdopen(read_end, "rb") as pipe:
        report = pipe.read()
    if os.WIFSIGNALED(status):
        return {"outcome": "crashed", "signal": signal.Signals(os.WTERMSIG(status)).name}
    return json.loads(report) if report else {"outcome": "crashed", "exit_status": os.waitstatus_to_exitcode(status)}


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict]:
    """Every case's outcome, from one interpreter that forks a child per case."""
    result = subprocess.run(
        [sys.executable, str(Path(__file__)), *CASES],
        capture_output=True,
        text=True,
        timeout=CASE_TIMEOUT_S * 4 + 120,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert len(lines) == len(CASES), result.stderr[-4000:]
    return {name: json.loads(line) for name, line in zip(CASES, lines)}


@pytest.mark.parametrize("name", list(CASES))
def test_a_wrong_call_is_refused_with_an_error(outcomes, name):
    outcome, words = outcomes[name], CASES[name][1]
    assert outcome["outcome"] == "raised", f"{name}: {outcome}"
    assert outcome["type"] in ("ValueError", "RuntimeError", "IndexError"), f"{name}: {outcome}"
    assert words in outcome["message"], f"{name}: {outcome['message']!r} lacks {words!r}"


def test_the_valid_calls_the_cases_start_from_run():
    """The cases' baselines are right: unchanged, each call goes through (so the error above is the edit's)."""
    torch.manual_seed(0)
    assert kernels().bind(int4_tiles())(torch.zeros(3, COLS)).shape == (3, ROWS)
    assert kernels().bind(int8_tiles(), rounding="int8")(torch.zeros(1, COLS)).shape == (1, ROWS)
    assert kernels().dequantize_rows(int4_tiles(), torch.tensor([0, ROWS - 1])).shape == (2, COLS)
    if kernels().kquant:
        assert kernels().bind_kquant(kquant_tiles(), many_rows=True)(torch.zeros(12, 256)).shape == (12, ROWS)
        assert kernels().kquant_dequantize_rows(kquant_tiles(), torch.tensor([0, ROWS - 1])).shape == (2, 256)
    attention_call()
    run_native_step()


if __name__ == "__main__":
    for case_name in sys.argv[1:]:
        print(json.dumps(run_case(case_name)), flush=True)
