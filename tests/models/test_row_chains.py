"""Sub-chains of the row-parallel projections (models/row_chains.py): a product split into runs of columns gives, bit
for bit, the runs' own products added in order, which is what tensor-parallel ranks compute."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from tokenriver.distributed.sharding import rank_runs, take_columns
from tokenriver.errors import InvalidParameterError
from tokenriver.loader.gguf_blocks import repack_q5_0
from tokenriver.models.cpu.kernels import load_kernels
from tokenriver.models.quant import Int4Linear, Int8Linear, quantize_int4, quantize_int8
from tokenriver.models.row_chains import run_boundaries

HAS_NATIVE = load_kernels() is not None


def test_runs_hold_every_boundary_of_two_four_and_eight_ranks():
    assert run_boundaries(48) == list(range(6, 49, 6))
    assert run_boundaries(3) == [2, 3]  # 3 kv heads: only 2 ranks split them, 2 + 1
    assert run_boundaries(1) == [1]
    assert run_boundaries(6) == [2, 3, 4, 5, 6]  # 2 ranks: 3 + 3; 4 ranks: 2 + 2 + 1 + 1
    for world_size in (2, 4, 8):
        runs = rank_runs(48, world_size)
        assert [run for share in runs for run in share] == [(end - 6, end) for end in range(6, 49, 6)]


def test_a_rank_count_with_boundaries_of_its_own_gets_them_as_runs():
    assert rank_runs(6, 5) == [[(0, 2)], [(2, 3)], [(3, 4)], [(4, 5)], [(5, 6)]]
    # 10 units: 2 ranks end at 5, 4 at 3, 6, 8, 8 at 2, 4 .. 9; 3 ranks' own boundaries, 4 and 7, are among them.
    assert rank_runs(10, 3) == [[(0, 2), (2, 3), (3, 4)], [(4, 5), (5, 6), (6, 7)], [(7, 8), (8, 9), (9, 10)]]


def layer(kind: str) -> Int4Linear | Int8Linear:
    weight = torch.randn(40, 384, generator=torch.Generator().manual_seed(7)) * 0.05
    options = {"backend": "native", "int8_activations": True, "max_gemv_rows": 8}
    if kind == "int4":
        return Int4Linear(quantize_int4(weight, 32), **options)
    if kind == "int5":
        return Int4Linear(repack_q5_0(quantize(weight.numpy(), GGMLQuantizationType.Q5_0)), **options)
    if kind == "int8-channel":
        return Int8Linear(quantize_int8(weight), **options)
    return Int8Linear(quantize_int8(weight, 32), **options)


@pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("kind", ["int4", "int5", "int8", "int8-channel"])
def test_a_split_row_is_its_runs_added_in_order(kind: str) -> None:
    whole = layer(kind)
    ends = [3, 4, 9, 12]  # blocks of 32 columns
    spans = list(zip([0, *ends[:-1]], ends, strict=True))
    runs = [take_columns(whole, 32 * start, 32 * end, False) for start, end in spans]
    whole.split_row_chains(ends)
    for rows in (1, 5, 8, 9, 16, 33, 64):  # the GEMV, and the GEMM past max_gemv_rows
        x = torch.randn(rows, 384)
        parts = [run(x[:, 32 * start : 32 * end].contiguous()) for run, (start, end) in zip(runs, spans, strict=True)]
        expected = parts[0]
        for part in parts[1:]:
            expected = expected + part
        assert torch.equal(whole(x), expected)


def test_sub_chains_must_cover_the_row():
    with pytest.raises(InvalidParameterError, match="in_features / 32 = 12"):
        layer("int4").split_row_chains([3, 2, 12])
    with pytest.raises(InvalidParameterError, match="in_features / 32 = 12"):
        layer("int4").split_row_chains([4, 8])
