"""Matrix products on decode and prefill shapes: how fast each candidate kernel streams the weights.

A decode step multiplies 1-8 activation rows (one per running request) by every weight matrix, so its time is
the time to read the weights: the number that matters is the effective bandwidth, weight bytes (scales included)
divided by time, next to what a plain read of the same bytes achieves. Prefill (512 rows) is compute-bound:
there GFLOP/s matters.

Weights are cold, as in a real decode step, where the whole model (96 MB for SmolLM2-135M Q4_1) passes through a
32 MB L3 per token: every candidate cycles through enough copies of its weight to fill POOL_BYTES. Candidates are
timed in interleaved rounds (each round times every candidate once), so a load spike from another process hits all
candidates alike; the best round ranks them (noise only adds time) and the median is reported beside it.

    python benchmarks/kernels.py [--repeats 7] [--threads 2] [--quick]

Writes benchmarks/results/kernels.md and kernels.png.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from common import RESULTS, machine_line, markdown_table
from tokenriver.models.cpu.kernels import load_kernels
from tokenriver.models.cpu.tiles import tile
from tokenriver.models.quant import Int4Linear, Int8Linear, quantize_int4, quantize_int8, unpack_int4

# [out_features N, in_features K]: SmolLM2-135M's q/o, gate/up, down, tied lm_head; and a 7B-class square matrix.
SHAPES = ((576, 576), (1536, 576), (576, 1536), (49152, 576), (4096, 4096))
ROWS = (1, 2, 4, 8, 32, 64, 512)
POOL_BYTES = 96 << 20
ROUND_SECONDS = 0.02
MAX_CALL_SECONDS = 1.0


@dataclass
class Candidate:
    name: str
    weight_bytes: int  # bytes one call reads from its weight (packed values + scales)
    call: Callable[[int], object]  # call(i) runs the product on weight copy i % copies


def num_copies(weight_bytes: int) -> int:
    return max(1, math.ceil(POOL_BYTES / weight_bytes))


def make_candidates(out_features: int, in_features: int, num_rows: int) -> list[Candidate]:
    """Every kernel for this shape; each owns copies of its weight in its own format."""
    weight = torch.randn(out_features, in_features) * 0.05  # [N, K]
    x32 = torch.randn(num_rows, in_features)  # [M, K]
    x16 = x32.bfloat16()
    kernels = load_kernels()
    int8 = quantize_int8(weight)
    int8_g32 = quantize_int8(weight, 32)
    int4 = quantize_int4(weight, 32)
    int4_values = unpack_int4(int4.qweight).to(torch.int32)  # [N, K]
    int4_bytes = int4.qweight.numel() + 4 * int4.scales.numel()
    candidates: list[Candidate] = []

    def add(name: str, weight_bytes: int, make_weight: Callable[[], object], run: Callable[[object], object]) -> None:
        copies = [make_weight() for _ in range(num_copies(weight_bytes))]
        candidates.append(Candidate(name, weight_bytes, lambda i: run(copies[i % len(copies)])))

    add(
        "memory read (torch.sum, int8-size buffer)",
        out_features * in_features,
        lambda: torch.randn(out_features * in_features // 4),
        lambda buffer: buffer.sum(),
    )
    add("F.linear fp32", 4 * weight.numel(), lambda: weight.clone(), lambda w: F.linear(x32, w))
    add("F.linear bf16", 2 * weight.numel(), lambda: weight.bfloat16(), lambda w: F.linear(x16, w))
    int8_bytes = int8.qweight.numel() + 4 * out_features
    scales32 = int8.scales.float().reshape(-1)  # [N]
    add(
        "aten int8pack_mm fp32 x",
        int8_bytes,
        lambda: int8.qweight.clone(),
        lambda w: torch.ops.aten._weight_int8pack_mm(x32, w, scales32),
    )
    add(
        "aten int8pack_mm bf16 x",
        int8_bytes,
        lambda: int8.qweight.clone(),
        lambda w: torch.ops.aten._weight_int8pack_mm(x16, w, scales32.bfloat16()),
    )
    if out_features % 16 == 0:
        scales_and_zeros = torch.stack(
            (int4.scales.float().t(), int4.mins.float().t() + 8 * int4.scales.float().t()), dim=-1
        ).contiguous()  # [K // 32, N, 2]
        pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        add(
            "aten int4pack_mm g32 fp32 x",
            int4_bytes,
            lambda: pack(int4_values, 1),
            lambda w: torch.ops.aten._weight_int4pack_mm_for_cpu(x32, w, 32, scales_and_zeros),
        )
        add(
            "aten int4pack_mm g32 bf16 x",
            int4_bytes,
            lambda: pack(int4_values, 1),
            lambda w: torch.ops.aten._weight_int4pack_mm_for_cpu(x16, w, 32, scales_and_zeros.bfloat16()),
        )
    symmetric_scales = int4.scales.float()  # [N, K // 32]: the op is symmetric, (q - 8) * scale
    nibbles = (int4_values[:, 1::2] << 4 | int4_values[:, 0::2]).to(torch.uint8)  # [N, K // 2]
    # Without KleidiAI (Arm only) the packed buffer is float32 with one element per byte: 4x the int4 bytes.
    if num_rows <= 64:
        add(
            "aten dyn_quant_matmul_4bit g32",
            int4_bytes,
            lambda: torch.ops.aten._dyn_quant_pack_4bit_weight(
                nibbles, symmetric_scales, None, 32, in_features, out_features
            ),
            lambda w: torch.ops.aten._dyn_quant_matmul_4bit(x32, w, 32, in_features, out_features),
        )
    if num_rows == 1:
        compiled = torch.compile(lambda x, q, s: F.linear(x, q.to(x.dtype)) * s, dynamic=False)
        add(
            "torch.compile int8 dequant+linear",
            int8_bytes,
            lambda: int8.qweight.clone(),
            lambda w: compiled(x32, w, scales32),
        )
    if kernels is not None:
        # Bound once per weight copy, as a layer does; scales and mins copied too, so they are cold as well.
        for name, weight_q, is_int4, activations_int8 in (
            ("native int8 per-channel", int8, False, False),
            ("native int8 g32 (Q8_0)", int8_g32, False, False),
            ("native int8 g32 (Q8_0) int8 x", int8_g32, False, True),
            ("native int4 g32 (Q4_1)", int4, True, False),
            ("native int4 g32 (Q4_1) int8 x", int4, True, True),
        ):
            size = weight_q.qweight.numel() + (4 if is_int4 else 2) * weight_q.scales.numel()

            def bind(w=weight_q, a=activations_int8, is_int4=is_int4):
                rounding = "int8" if a else None
                mins = w.mins if is_int4 else None
                return kernels.bind(tile(w.qweight, w.scales, mins, None, w.group_size), rounding)

            add(name, size, bind, lambda linear: linear(x32))
        if num_rows >= 8:
            # What Int4Linear does above max_gemv_rows (gemm.cpp), and the float32 sgemm it replaced.
            add(
                "native int4 GEMM (Q4_1)",
                int4_bytes,
                lambda: kernels.bind(tile(int4.qweight, int4.scales, int4.mins, None, 32), many_rows=True),
                lambda gemm: gemm(x32),
            )
            add(
                "native int4 dequantize + F.linear fp32",
                int4_bytes,
                lambda: int4.qweight.clone(),
                lambda w: F.linear(x32, kernels.int4_dequantize(w, int4.scales, int4.mins, 32)),
            )
    return candidates


def measure(candidates: list[Candidate], repeats: int) -> dict[str, tuple[float, float]]:
    """(fastest, median) seconds per call of each candidate over interleaved rounds; inf beyond MAX_CALL_SECONDS."""
    calls: dict[str, int] = {}
    for candidate in candidates:
        started = time.perf_counter()
        candidate.call(0)  # warm-up (and compilation, for torch.compile)
        if time.perf_counter() - started > 3 * MAX_CALL_SECONDS:
            calls[candidate.name] = 0
            continue
        started = time.perf_counter()
        candidate.call(1)
        per_call = time.perf_counter() - started
        calls[candidate.name] = 0 if per_call > MAX_CALL_SECONDS else max(1, int(ROUND_SECONDS / per_call))
    rounds: dict[str, list[float]] = {candidate.name: [] for candidate in candidates}
    for _ in range(repeats):
        for candidate in candidates:
            count = calls[candidate.name]
            if count == 0:
                continue
            started = time.perf_counter()
            for i in range(count):
                candidate.call(i)
            rounds[candidate.name].append((time.perf_counter() - started) / count)
    return {
        name: (min(times), statistics.median(times)) if times else (math.inf, math.inf)
        for name, times in rounds.items()
    }


# One decode step of SmolLM2-135M, matrix products only: per layer q, k, v, o, gate, up, down; then the tied lm_head.
SMOLLM2_LAYER = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
SMOLLM2_LAYERS = 30
SMOLLM2_LM_HEAD = (49152, 576)


def smollm2_step_layers(kind: str) -> list[torch.nn.Module]:
    """The 211 linear layers of one SmolLM2-135M decode step as `kind` stores them (random weights, real shapes)."""
    shapes = [shape for _ in range(SMOLLM2_LAYERS) for shape in SMOLLM2_LAYER] + [SMOLLM2_LM_HEAD]
    layers: list[torch.nn.Module] = []
    for index, (out_features, in_features) in enumerate(shapes):
        weight = torch.randn(out_features, in_features) * 0.05
        is_lm_head = index == len(shapes) - 1
        if kind.startswith("F.linear"):
            linear = torch.nn.Linear(in_features, out_features, bias=False)
            linear.weight.data = weight.to(torch.bfloat16 if "bf16" in kind else torch.float32)
            layers.append(linear)
        else:
            options = dict(backend="native", int8_activations="int8 x" in kind)
            # As in the GGUF file: Q4_1 everywhere, Q8_0 for the tied embedding / lm_head.
            layers.append(
                Int8Linear(quantize_int8(weight, 32), **options)
                if is_lm_head
                else Int4Linear(quantize_int4(weight, 32), **options)
            )
    return layers


def measure_smollm2_step(repeats: int) -> list[list[object]]:
    """Seconds per decode step (1 row) of the 211 products, each kind in interleaved rounds."""
    kinds = ["F.linear fp32", "F.linear bf16"]
    if load_kernels() is not None:
        kinds += ["native int4/int8 exact", "native int4/int8 int8 x"]
    models = {kind: smollm2_step_layers(kind) for kind in kinds}
    inputs = {576: torch.randn(1, 576), 1536: torch.randn(1, 1536)}

    def step(layers: list[torch.nn.Module], dtype: torch.dtype) -> None:
        for layer in layers:
            layer(inputs[layer.in_features].to(dtype))

    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    with torch.inference_mode():
        for round_index in range(repeats + 1):
            for kind in kinds:
                dtype = torch.bfloat16 if "bf16" in kind else torch.float32
                started = time.perf_counter()
                for _ in range(5):
                    step(models[kind], dtype)
                if round_index:  # the first round warms up
                    times[kind].append((time.perf_counter() - started) / 5)
    rows = []
    for kind in kinds:
        weight_bytes = sum(
            b.numel() * b.element_size()
            for layer in models[kind]
            for b in list(layer.parameters()) + list(layer.buffers())
        )
        seconds = min(times[kind])
        rows.append(
            [
                kind,
                f"{weight_bytes / 1e6:.0f}",
                f"{seconds * 1e3:.2f}",
                f"{statistics.median(times[kind]) * 1e3:.2f}",
                f"{1 / seconds:.0f}",
                f"{weight_bytes / seconds / 1e9:.1f}",
            ]
        )
    return rows


def plot(results: dict[tuple[int, int, int], dict[str, tuple[float, float, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name in next(iter(results.values()))]
    colors = {name: plt.get_cmap("tab20")(index % 20) for index, name in enumerate(names)}
    figure, (left, right) = plt.subplots(1, 2, figsize=(16, 6.5))
    one_row = [shape for shape in SHAPES if (shape[0], shape[1], 1) in results]
    width = 0.8 / len(names)
    for index, name in enumerate(names):
        values = [results[(n, k, 1)].get(name, (0, 0, 0))[1] for n, k in one_row]
        left.bar(
            [i + index * width for i in range(len(one_row))],
            values,
            width,
            label=name,
            color=colors[name],
            hatch="//" if "memory" in name else None,
        )
    left.set_xticks([i + 0.4 for i in range(len(one_row))], [f"{n}×{k}" for n, k in one_row])
    left.set_ylabel("effective GB/s (weight bytes / time)")
    left.set_title("1 row (single-stream decode), cold weights")
    left.legend(fontsize=7)
    n, k = 1536, 576
    for name in names:
        points = [
            (rows, results[(n, k, rows)][name][2])
            for rows in ROWS
            if (n, k, rows) in results
            and name in results[(n, k, rows)]
            and "memory" not in name
            and math.isfinite(results[(n, k, rows)][name][0])
        ]
        if points:
            right.plot(*zip(*points), marker="o", label=name, color=colors[name])
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("activation rows")
    right.set_ylabel("GFLOP/s")
    right.set_title(f"{n}×{k} (gate/up projection) by number of rows")
    right.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="SmolLM2 shapes and 1-8 rows only")
    parser.add_argument("--output", default=str(RESULTS / "kernels.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_start = os.getloadavg()
    shapes = SHAPES[:4] if args.quick else SHAPES
    rows_list = tuple(r for r in ROWS if r <= 8) if args.quick else ROWS
    step_rows = measure_smollm2_step(args.repeats)
    print("SmolLM2-135M decode step (products only):", step_rows, flush=True)
    results: dict[tuple[int, int, int], dict[str, tuple[float, float, float]]] = {}
    sections = []
    for out_features, in_features in shapes:
        table = []
        for num_rows in rows_list:
            candidates = make_candidates(out_features, in_features, num_rows)
            seconds = measure(candidates, args.repeats)
            flops = 2 * num_rows * out_features * in_features
            entry = {}
            for candidate in candidates:
                time_s, median_s = seconds[candidate.name]
                entry[candidate.name] = (time_s, candidate.weight_bytes / time_s / 1e9, flops / time_s / 1e9)
                table.append(
                    [
                        num_rows,
                        candidate.name,
                        f"{time_s * 1e6:.1f}" if math.isfinite(time_s) else "> 1 s",
                        f"{median_s * 1e6:.1f}" if math.isfinite(median_s) else "> 1 s",
                        entry[candidate.name][1],
                        entry[candidate.name][2],
                    ]
                )
            results[(out_features, in_features, num_rows)] = entry
            best = min((name for name in entry if "memory" not in name), key=lambda name: entry[name][0])
            print(
                f"{out_features}x{in_features} rows={num_rows}: best {best} {entry[best][0] * 1e6:.1f} us, "
                + ", ".join(f"{name} {value[1]:.1f} GB/s" for name, value in entry.items()),
                flush=True,
            )
            del candidates
        sections.append(
            f"### {out_features}×{in_features} (N×K)\n\n"
            + markdown_table(
                ["rows", "kernel", "µs / call (best)", "µs / call (median)", "effective GB/s (best)", "GFLOP/s (best)"],
                table,
            )
        )
    summary = []
    for (out_features, in_features, num_rows), entry in results.items():
        kernels_only = {name: value for name, value in entry.items() if "memory" not in name}
        exact = {
            name: value for name, value in kernels_only.items() if "int8 x" not in name and "dyn_quant" not in name
        }
        fastest = min(kernels_only, key=lambda name: kernels_only[name][0])
        fastest_exact = min(exact, key=lambda name: exact[name][0])
        memory = next(value for name, value in entry.items() if "memory" in name)
        summary.append(
            [
                f"{out_features}×{in_features}",
                num_rows,
                f"{memory[1]:.1f}",
                f"{fastest_exact} ({exact[fastest_exact][0] * 1e6:.0f} µs, {exact[fastest_exact][1]:.1f} GB/s)",
                f"{fastest} ({kernels_only[fastest][0] * 1e6:.0f} µs)",
                f"{kernels_only['F.linear fp32'][0] * 1e6:.0f}",
            ]
        )
    sections.insert(
        0,
        "## Fastest per shape\n\nExact = float32 accumulation over the exactly dequantized weights "
        "(everything but the int8-activation and dyn_quant kernels, which round activations to 8 bits)."
        "\n\n"
        + markdown_table(
            ["N×K", "rows", "memory read GB/s", "fastest exact kernel", "fastest overall", "F.linear fp32 µs"], summary
        )
        + "\n\n## All measurements",
    )
    sections.insert(
        0,
        "## One SmolLM2-135M decode step, products only\n\nThe 211 linear layers of one token "
        "(30 × q, k, v, o, gate, up, down + the 49152×576 lm_head), 1 row, called in sequence through "
        "the layer modules (Python overhead included, attention and norms excluded): an upper bound on "
        "decode tokens/s from the matrix products alone.\n\n"
        + markdown_table(
            [
                "weights as",
                "MB read per token",
                "ms per step (best)",
                "ms per step (median)",
                "steps/s (best)",
                "effective GB/s (best)",
            ],
            step_rows,
        ),
    )
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    plot(results, output.with_suffix(".png"))
    load_end = os.getloadavg()
    header = (
        f"# Kernel measurements\n\n{machine_line()}\n\nCommand: `python benchmarks/kernels.py "
        f"{' '.join(sys.argv[1:])}`. {args.repeats} interleaved rounds; weights cold (each candidate cycles "
        f"through {POOL_BYTES >> 20} MB of copies). Effective GB/s = bytes of the weight in that kernel's "
        f"format (values + scales) / time. Load average (1 min) {load_start[0]:.2f} at the start, "
        f"{load_end[0]:.2f} at the end: other processes share the two cores, and noise only ever adds time, "
        f"so rankings use the best round and the median is shown beside it.\n\n![kernels](kernels.png)\n\n"
    )
    output.write_text(header + "\n\n".join(sections) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
