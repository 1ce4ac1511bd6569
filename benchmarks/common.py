"""Helpers shared by the benchmarks: the embedded model, prompts of an exact length, result files."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
FILLER = (
    "The river carries tokens from the mountains to the sea, and every bend of it is a step of the model. "
    "Engineers measure its flow, count the stones, and write down what they see. "
)


def prompt_ids(tokenizer, num_tokens: int) -> list[int]:
    """Token ids of natural-looking text cut to exactly num_tokens."""
    text = FILLER
    while len(tokenizer.encode(text)) < num_tokens:
        text += FILLER
    return tokenizer.encode(text)[:num_tokens]


# The instruction sets that pick a kernel path: results from machines that differ in them are not comparable.
VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        flags = next(line.split(":", 1)[1].split() for line in lines if line.startswith("flags"))
        cpu += f" ({' '.join(flag for flag in VECTOR_FLAGS if flag in flags) or 'no AVX2'})"
    except (OSError, StopIteration):
        pass
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    return (
        f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{os.cpu_count()} cores visible, commit {commit or 'unknown'}"
    )


def rounded_products() -> str:
    """How this machine's kernels run the rounded mode's (`int8_activations=True`) products of more than
    max_gemv_rows rows (models/quant.py): the words the benchmark reports use."""
    from tokenriver.models.cpu.kernels import load_kernels

    kernels = load_kernels()
    if kernels is None:
        return "PyTorch's products (no native kernels)"
    if kernels.gemm_int8:
        return "int8 activations, the GEMM (this CPU has AVX512-VNNI)"
    return "int8 activations, the GEMV (this CPU lacks AVX512-VNNI)"


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in row) + " |")
    return "\n".join(lines)
