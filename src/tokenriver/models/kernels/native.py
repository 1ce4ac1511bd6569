"""Build and call the native quantized GEMV kernels in gemv.cpp.

PyTorch's own packed-weight CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) stream the weights
of a one-row product far below memory speed on this class of machine (see benchmarks/results/kernels.md), so the
decode-shaped products run here instead. The source is compiled once per machine with the system C++ compiler
(`-O3 -march=native -fopenmp`) into a cache folder keyed by the source, the compiler and the CPU flags, and called
through ctypes: no PyTorch headers, so a build takes about a second, not a minute.

Contract: `load_kernels()` returns `NativeKernels`, or None when the CPU lacks AVX2/FMA/F16C or no compiler
works; callers then use the pure-PyTorch path, which computes the same sums (models/quant.py). Nothing here knows
about files or models: tensors in, tensors out, CPU only.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gemv.cpp")
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


def _cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    for line in lines:
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _cache_dir() -> Path:
    return Path.home() / ".cache" / "tokenriver" / "kernels"


def _build(compiler: str, flags: set[str]) -> Path:
    """Compile gemv.cpp unless a build of this exact source for this CPU and compiler is cached."""
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(source + version.encode() + " ".join(COMPILE_FLAGS).encode()
                         + " ".join(sorted(flags)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"gemv-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename: two processes building at once each publish a whole file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / "gemv.so"
        subprocess.run([compiler, *COMPILE_FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True,
                       check=True)
        os.replace(built, target)
    return target


class NativeKernels:
    """Typed wrappers around the compiled functions; every tensor argument must be contiguous and on the CPU.

    A layer binds its weight once (`bind_int4` / `bind_int8`) and gets a function of the activations only: the
    weight's pointers and sizes are converted to C once, not on each of the ~200 calls of a decode step.
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        int4_args = [ptr, ptr, ptr, i64, i64, i64, ptr, i64, ptr, c_int]
        int8_args = [ptr, ptr, i64, i64, i64, ptr, i64, ptr, c_int]
        self._functions = {}
        for name, argtypes in (("int4_linear_f32", int4_args), ("int4_linear_int8x", int4_args),
                               ("int8_linear_f32", int8_args), ("int8_linear_int8x", int8_args),
                               ("int4_dequantize", [ptr, ptr, ptr, i64, i64, i64, ptr, c_int]),
                               ("int8_dequantize", [ptr, ptr, i64, i64, i64, ptr, c_int])):
            function = getattr(library, name)
            function.argtypes = argtypes
            function.restype = None
            self._functions[name] = function

    def bind_int4(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                  int8_activations: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
        """x [M, K] float32 ↦ x @ dequantized int4 weight [N, K]ᵀ, [M, N] float32.

        int8_activations rounds x to int8 per 32 columns first (llama.cpp's arithmetic): faster, less exact.
        The function keeps the tensors alive; rebind after moving or replacing them.
        """
        out_features, in_features = qweight.shape[0], qweight.shape[1] * 2
        function = self._functions["int4_linear_int8x" if int8_activations else "int4_linear_f32"]
        weight = (qweight.data_ptr(), scales.data_ptr(), mins.data_ptr(), out_features, in_features, group_size)
        tensors = (qweight, scales, mins)

        def linear(x: torch.Tensor) -> torch.Tensor:
            y = torch.empty(x.shape[0], out_features, dtype=torch.float32)  # [M, N]
            function(*weight, x.data_ptr(), x.shape[0], y.data_ptr(), torch.get_num_threads())
            return y

        linear.tensors = tensors  # the closure holds raw pointers: keep the tensors they point into alive
        return linear

    def bind_int8(self, qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
                  int8_activations: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
        """x [M, K] float32 ↦ x @ dequantized int8 weight [N, K]ᵀ, [M, N] float32 (int8_activations as above)."""
        out_features, in_features = qweight.shape
        function = self._functions["int8_linear_int8x" if int8_activations else "int8_linear_f32"]
        weight = (qweight.data_ptr(), scales.data_ptr(), out_features, in_features, group_size)
        tensors = (qweight, scales)

        def linear(x: torch.Tensor) -> torch.Tensor:
            y = torch.empty(x.shape[0], out_features, dtype=torch.float32)  # [M, N]
            function(*weight, x.data_ptr(), x.shape[0], y.data_ptr(), torch.get_num_threads())
            return y

        linear.tensors = tensors  # the closure holds raw pointers: keep the tensors they point into alive
        return linear

    def int4_linear(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                    group_size: int, int8_activations: bool = False) -> torch.Tensor:
        """One-off bind_int4(...)(x)."""
        return self.bind_int4(qweight, scales, mins, group_size, int8_activations)(x)

    def int8_linear(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
                    int8_activations: bool = False) -> torch.Tensor:
        """One-off bind_int8(...)(x)."""
        return self.bind_int8(qweight, scales, group_size, int8_activations)(x)

    def int4_dequantize(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                        group_size: int) -> torch.Tensor:
        """The float32 weight [N, K]: for many activation rows (prefill) one sgemm beats decoding per row."""
        out_features, in_features = qweight.shape[0], qweight.shape[1] * 2
        out = torch.empty(out_features, in_features, dtype=torch.float32)  # [N, K]
        self._functions["int4_dequantize"](qweight.data_ptr(), scales.data_ptr(), mins.data_ptr(), out_features,
                                           in_features, group_size, out.data_ptr(), torch.get_num_threads())
        return out

    def int8_dequantize(self, qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
        """The float32 weight [N, K]."""
        out_features, in_features = qweight.shape
        out = torch.empty(out_features, in_features, dtype=torch.float32)  # [N, K]
        self._functions["int8_dequantize"](qweight.data_ptr(), scales.data_ptr(), out_features, in_features,
                                           group_size, out.data_ptr(), torch.get_num_threads())
        return out


@functools.cache
def load_kernels() -> NativeKernels | None:
    """The compiled kernels, or None (with the reason logged once) where they cannot run."""
    flags = _cpu_flags()
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in flags]
    if platform.machine() not in ("x86_64", "AMD64") or missing:
        logger.info("native quantized kernels off: CPU %s lacks %s", platform.machine(), missing or "x86-64")
        return None
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        logger.info("native quantized kernels off: no C++ compiler (c++ or g++) on PATH")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler, flags)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        logger.warning("native quantized kernels off: build failed: %s", detail.strip()[:2000])
        return None
    return NativeKernels(library)
