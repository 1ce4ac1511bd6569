"""The K-quant products against the machine's int8 ceiling: how far a prefill can go.

A prefill or a 32-request decode step is bound by arithmetic: every weight is used by many activation rows. The
ceiling is the int8 multiply-add rate of 512-bit dpbusd, measured here by csrc/int8_peak.cpp (independent chains,
no memory traffic), once per round, the best kept: on a virtual machine two threads reach twice one thread's rate
only while their virtual CPUs sit on separate cores. Beside it, each K-quant type's product (models/kquant.py's
KQuantLinear with the engine's default int8 activations) on a 4608 x 1536 matrix (the 0.8B file's gate/up rows by
its hidden size) at 1, 32 and 512 activation rows, in multiply-adds per second, and what share of the ceiling that
is. Types run in interleaved rounds; the best round counts (noise only adds time).

Why the share stays under two thirds: the engine's arithmetic rounds activations to int8 per 32 columns, so each
block of 32 columns ends, per weight row and 16 activation rows, in a float step (convert, scale product, FMA,
and an FMA for a minimum) beside its 8 dpbusd, on the same vector pipes.

    python benchmarks/kquant_roofline.py [--threads 2] [--rounds 5]

Writes benchmarks/results/kquant_roofline.md and kquant_roofline.png.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import RESULTS, machine_line, markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
from kquant_weights import KINDS, random_kquant  # noqa: E402

from tokenriver.models.cpu.kernels import load_kernels  # noqa: E402
from tokenriver.models.kquant import KQuantLinear  # noqa: E402

SHAPE = (4608, 1536)
ROWS = (1, 32, 512)
PEAK_SOURCE = Path(__file__).resolve().parent / "csrc" / "int8_peak.cpp"


def build_int8_peak(scratch: Path) -> Path | None:
    """csrc/int8_peak.cpp compiled into scratch, or None without a compiler or AVX512-VNNI."""
    compiler = shutil.which("c++") or shutil.which("g++")
    binary = scratch / "int8_peak"
    flags = ["-O2", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-fopenmp"]
    if compiler is None or subprocess.run([compiler, *flags, str(PEAK_SOURCE), "-o", str(binary)]).returncode:
        return None
    return binary


def int8_peak(binary: Path | None, threads: int) -> float:
    """Multiply-adds per second of dpbusd on `threads` threads (0 where it cannot run)."""
    if binary is None:
        return 0.0
    done = subprocess.run([str(binary), str(threads)], capture_output=True, text=True)
    return float(done.stdout.split()[-1]) if done.returncode == 0 else 0.0


def product_rates(rounds: int, peak_binary: Path | None, threads: int) -> tuple[float, dict[str, dict[int, float]]]:
    """(the int8 ceiling, {type: {activation rows: multiply-adds per second}}), the best of `rounds` interleaved
    rounds."""
    layers = {}
    for kind in KINDS:
        layer = KQuantLinear(random_kquant(*SHAPE, kind))
        layer.set_int8_activations(True)
        layers[kind] = layer
    inputs = {rows: torch.randn(rows, SHAPE[1]) for rows in ROWS}
    best = {kind: {rows: 0.0 for rows in ROWS} for kind in KINDS}
    peak = 0.0
    for _ in range(rounds):
        peak = max(peak, int8_peak(peak_binary, threads))
        for rows, x in inputs.items():
            for kind, layer in layers.items():
                calls, start = 0, time.perf_counter()
                while time.perf_counter() - start < 0.3:
                    layer(x)
                    calls += 1
                rate = calls * rows * SHAPE[0] * SHAPE[1] / (time.perf_counter() - start)
                best[kind][rows] = max(best[kind][rows], rate)
    return peak, best


def report(peak: float | None, rates: dict[str, dict[int, float]], args: argparse.Namespace) -> None:
    headers = ["type", *(f"{rows} rows, GMAC/s" for rows in ROWS), *(f"{rows} rows, share" for rows in ROWS[1:])]
    rows = []
    for kind, by_rows in rates.items():
        shares = [f"{by_rows[r] / peak:.0%}" if peak else "-" for r in ROWS[1:]]
        rows.append([kind, *(f"{by_rows[r] / 1e9:.0f}" for r in ROWS), *shares])
    peak_line = f"{peak / 1e9:.0f} GMAC/s" if peak else "not measured (no compiler or no AVX512-VNNI)"
    text = "\n".join(
        [
            "# K-quant products against the int8 ceiling",
            "",
            machine_line(),
            "",
            f"Command: `python benchmarks/kquant_roofline.py --threads {args.threads} --rounds {args.rounds}`",
            "",
            f"Ceiling (512-bit dpbusd, {args.threads} threads, csrc/int8_peak.cpp, the best round): {peak_line}. "
            f"Products of a "
            f"{SHAPE[0]} x {SHAPE[1]} matrix with int8 activations (the engine's default), best of {args.rounds} "
            "interleaved rounds; share = rate / ceiling.",
            "",
            "![K-quant products](kquant_roofline.png)",
            "",
            markdown_table(headers, rows),
            "",
        ]
    )
    (RESULTS / "kquant_roofline.md").write_text(text)
    plot(peak, rates)
    print(text)


def plot(peak: float | None, rates: dict[str, dict[int, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(ROWS)
    for i, rows in enumerate(ROWS):
        positions = [k + i * width for k in range(len(rates))]
        axes.bar(positions, [rates[kind][rows] / 1e9 for kind in rates], width, label=f"{rows} rows")
    if peak:
        axes.axhline(peak / 1e9, color="black", linestyle="--", label="int8 ceiling (dpbusd)")
    axes.set_xticks([k + width for k in range(len(rates))], list(rates))
    axes.set_ylabel("billion multiply-adds / s")
    axes.set_title("K-quant products, int8 activations")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(RESULTS / "kquant_roofline.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_kernels()
    if kernels is None or not kernels.kquant:
        raise SystemExit("the K-quant products need the native kernels on a CPU with AVX512-VNNI")
    with tempfile.TemporaryDirectory() as scratch:
        peak, rates = product_rates(args.rounds, build_int8_peak(Path(scratch)), args.threads)
    report(peak or None, rates, args)


if __name__ == "__main__":
    main()
