"""Many-row matrix products (batched decode, prefill): the native GEMMs against PyTorch's on a float copy.

With 12 or more activation rows a product is bound by arithmetic, not by reading the weights. Before gemm.cpp,
Int4Linear / Int8Linear kept a float32 copy of each weight for such products and called F.linear (MKL's sgemm);
gemm.cpp decodes a few weight rows at a time into a small buffer instead, with no copy kept. This times, on one
whole SmolLM2-135M step's products (30 layers of fused qkv 960×576, o 576×576, fused gate/up 3072×576, down
576×1536, then the tied 49152×576 lm_head; Q4_1 and Q8_0 weights as in the GGUF file, random values):
- exact float32: the native GEMM against MKL's sgemm on a float32 copy;
- the rounded mode (models/quant.py, `int8_activations=True`): int8 activations where the CPU has AVX512-VNNI
  (gemm.cpp); against F.linear on a bfloat16 copy (oneDNN: what transformers runs in bfloat16).
Every kind runs in interleaved rounds so that drift hits all alike; the best round counts (noise only adds time).
The 1-10-row GEMV is measured in kernels.py; the engine switches from it to the GEMM above max_gemv_rows.

    python benchmarks/gemm.py [--rows 12 16 32 64 128 512] [--repeats 5] [--threads 2]

Writes benchmarks/results/gemm.md and gemm.png.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from common import RESULTS, machine_line, markdown_table
from tokenriver.models.cpu.kernels import load_kernels
from tokenriver.models.cpu.tiles import tile
from tokenriver.models.quant import quantize_int4, quantize_int8

# [out_features N, in_features K] of one layer with the engine's fused projections, and the lm_head.
LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))
NUM_LAYERS = 30
LM_HEAD = (49152, 576)


def step_products(kernels) -> tuple[dict[str, list], list]:
    """({kind: native product functions}, float32 weights) for every product of one step, the same weights in
    all; kinds: "exact", and "int8" where this CPU's kernels have it."""
    shapes = [shape for _ in range(NUM_LAYERS) for shape in LAYER] + [LM_HEAD]
    roundings = [None] + (["int8"] if kernels.gemm_int8 else [])
    native: dict[str | None, list] = {rounding: [] for rounding in roundings}
    dense = []
    for index, (out_features, in_features) in enumerate(shapes):
        weight = torch.randn(out_features, in_features) * 0.05
        if index == len(shapes) - 1:
            q8 = quantize_int8(weight, 32)
            for rounding in roundings:
                native[rounding].append(
                    kernels.bind(tile(q8.qweight, q8.scales, None, None, 32), rounding, many_rows=True)
                )
            dense.append(kernels.int8_dequantize(q8.qweight, q8.scales, 32))
        else:
            q4 = quantize_int4(weight, 32)
            for rounding in roundings:
                native[rounding].append(
                    kernels.bind(tile(q4.qweight, q4.scales, q4.mins, None, 32), rounding, many_rows=True)
                )
            dense.append(kernels.int4_dequantize(q4.qweight, q4.scales, q4.mins, 32))
    return native, dense


NAMES = {
    None: "native GEMM, exact (gemm.cpp)",
    "int8": "native, int8 activations (gemm.cpp, VNNI)",
}
MKL = "MKL sgemm on a float32 copy"
ONEDNN = "F.linear on a bfloat16 copy (oneDNN)"


def measure(num_rows: int, native: dict, dense: list, dense_bf16: list, repeats: int) -> dict[str, float]:
    """Best seconds per step of each kind over interleaved rounds (the first round warms up)."""
    inputs = {576: torch.randn(num_rows, 576), 1536: torch.randn(num_rows, 1536)}
    inputs_bf16 = {size: x.bfloat16() for size, x in inputs.items()}
    kinds = {
        NAMES[rounding]: (lambda products=products: [gemm(inputs[w.shape[1]]) for gemm, w in zip(products, dense)])
        for rounding, products in native.items()
    }
    kinds[MKL] = lambda: [F.linear(inputs[w.shape[1]], w) for w in dense]
    kinds[ONEDNN] = lambda: [F.linear(inputs_bf16[w.shape[1]], w) for w in dense_bf16]
    best = {kind: float("inf") for kind in kinds}
    for round_index in range(repeats + 1):
        for kind, run in kinds.items():
            started = time.perf_counter()
            run()
            if round_index:
                best[kind] = min(best[kind], time.perf_counter() - started)
    return best


def plot(results: dict[int, dict[str, float]], flops_per_row: int, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7.5, 4.5))
    rows = sorted(results)
    for kind in next(iter(results.values())):
        axis.plot(rows, [flops_per_row * r / results[r][kind] / 1e9 for r in rows], marker="o", label=kind)
    axis.set_xscale("log", base=2)
    axis.set_xticks(rows, [str(r) for r in rows])
    axis.set_xlabel("activation rows (running sequences, or prompt tokens)")
    axis.set_ylabel("GFLOP/s over one whole step's products")
    axis.set_title("SmolLM2-135M step products, Q4_1 / Q8_0 weights")
    axis.set_ylim(bottom=0)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[12, 16, 32, 64, 128, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=str(RESULTS / "gemm.md"))
    args = parser.parse_args()
    if any(rows < 1 for rows in args.rows):
        parser.error("--rows must be positive")
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the native kernels need an x86-64 CPU with AVX2, FMA and F16C and a C++ compiler")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_start = os.getloadavg()[0]
    native, dense = step_products(kernels)
    dense_bf16 = [w.bfloat16() for w in dense]
    flops_per_row = 2 * sum(w.numel() for w in dense)
    rounded = [NAMES[rounding] for rounding in native if rounding is not None]
    results = {}
    table = []
    for num_rows in args.rows:
        best = measure(num_rows, native, dense, dense_bf16, args.repeats)
        results[num_rows] = best
        ours, mkl = best[NAMES[None]], best[MKL]
        row = [num_rows, f"{ours * 1e3:.1f}", f"{mkl * 1e3:.1f}", f"{mkl / ours:.2f}x"]
        for kind in rounded:
            row += [f"{best[kind] * 1e3:.1f}", f"{best[ONEDNN] / best[kind]:.2f}x"]
        row += [f"{best[ONEDNN] * 1e3:.1f}"]
        table.append(row)
        print(row, flush=True)
    output = RESULTS / "gemm.png"
    plot(results, flops_per_row, output)
    weight_mb = sum(w.numel() for w in dense) * 4 / 1e6
    headers = ["rows", "native exact ms / step", "MKL sgemm ms / step", "MKL / native"]
    for kind in rounded:
        headers += [f"{kind} ms / step", "oneDNN bf16 / it"]
    headers += ["oneDNN bf16 ms / step"]
    text = "\n".join(
        [
            "# Many-row products: native GEMMs vs PyTorch on a float copy",
            "",
            machine_line(),
            "",
            f"Command: `python benchmarks/gemm.py --repeats {args.repeats}`. One SmolLM2-135M step's products "
            f"({flops_per_row / 1e6:.0f} MFLOP per row), best of {args.repeats} interleaved rounds. Load average "
            f"(1 min) {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end. The MKL column needs a "
            f"float32 copy of the weights ({weight_mb:.0f} MB), the oneDNN one a bfloat16 copy "
            f"({weight_mb / 2:.0f} MB); the native products read the packed Q4_1 / Q8_0 bytes. Exact: float32 sums "
            "of the float32 activations. Rounded: the products `int8_activations=True` runs (activations rounded to "
            "int8 per 32 columns), against F.linear in bfloat16 (activations and weights rounded to bfloat16, "
            "float32 sums).",
            "",
            f"![gemm]({output.name})",
            "",
            markdown_table(headers, table),
            "",
        ]
    )
    open(args.output, "w").write(text)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
