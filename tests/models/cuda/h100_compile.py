"""Compiles every Triton kernel of models/cuda for an H100 (sm_90) down to a cubin, without a GPU, and prints each
launch's kernel name and resource use as JSON lines: run in its own process by test_kernels_compile.py.

It must be its own process: under TRITON_INTERPRET (set by tests/conftest.py without a GPU) Triton replaces its
language functions with the interpreter's when it is imported, and the compiler cannot use those. Here Triton is
imported without it, and its driver is swapped for one that names an sm_90 target: a launch compiles the kernel
(Triton's front end, its NVIDIA back end, then ptxas) and stops before running it. The tensors are CPU tensors that
no kernel reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from tokenriver.models.cuda import fused_ops, kv_write, paged_decode, quant_matmul

H100 = GPUTarget("cuda", 90, 32)
# (hidden, intermediate, heads, kv heads, head dim, rotary dims): SmolLM2-135M, Llama-3.2-1B, Qwen2.5-0.5B (seven
# query heads a kv head), Gemma 3 270M (head dim 256, one kv head), Phi-3 mini (with partial rotary dims).
SHAPES = {
    "smollm2-135m": (576, 1536, 9, 3, 64, 64),
    "llama-3.2-1b": (2048, 8192, 32, 8, 64, 64),
    "qwen2.5-0.5b": (896, 4864, 14, 2, 64, 64),
    "gemma3-270m": (640, 2048, 4, 1, 256, 256),
    "phi3-mini": (3072, 8192, 32, 32, 96, 32),
}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class _TargetOnly:
    """Triton's driver, reduced to what compiling asks of it: the target, and a device and stream to name."""

    def get_current_target(self) -> GPUTarget:
        return H100

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def _layer_kernels(
    dtype: torch.dtype, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, rotary_dims: int
) -> None:
    """One call of each layer kernel the way the engine makes it: a decode batch of 3 tokens."""
    tokens = 3
    x, weight = torch.empty(tokens, hidden, dtype=dtype), torch.empty(hidden, dtype=dtype)
    fused_ops.rms_norm(x, weight, 1e-6)
    fused_ops.rms_norm(x, weight, 1e-6, residual=torch.empty_like(x))
    fused_ops.rms_norm(torch.empty(tokens * heads, head_dim, dtype=dtype), torch.empty(head_dim, dtype=dtype), 1e-6)
    qkv = torch.empty(tokens, heads + 2 * kv_heads, head_dim, dtype=dtype)
    cos = torch.empty(tokens, 1, rotary_dims // 2, dtype=dtype)
    fused_ops.rotary_(qkv[:, : heads + kv_heads, :rotary_dims], cos, cos)
    gate_up = torch.empty(tokens, 2 * intermediate, dtype=dtype)
    fused_ops.silu_and_mul(gate_up)
    fused_ops.gelu_tanh_and_mul(gate_up)
    cache = torch.empty(32, 16, kv_heads, head_dim, dtype=dtype)
    kv_write.write_kv(
        qkv[:, heads : heads + kv_heads],
        qkv[:, heads + kv_heads :],
        cache,
        cache,
        torch.zeros(tokens, dtype=torch.int64),
    )
    lengths = torch.ones(tokens, dtype=torch.int64)
    for width in (8, 64):  # contexts of one partition, and split ones with their merge
        tables = torch.zeros(tokens, width, dtype=torch.int64)
        paged_decode.paged_decode_attention(qkv[:, :heads], cache, cache, tables, lengths, head_dim**-0.5)
        paged_decode.paged_decode_attention(
            qkv[:, :heads], cache, cache, tables, lengths, head_dim**-0.5, window=512, softcap=50.0
        )


def _quantized_kernels(dtype: torch.dtype, rows: int) -> None:
    """The fused int4 and int8 products at a decode's and a batch's rows, and the weight decode."""
    n, k = 4096, 2048
    x = torch.empty(rows, k, dtype=dtype)
    scales = torch.empty(n, k // 32, dtype=torch.float16)
    quant_matmul.int4_matmul(x, torch.empty(n, k // 2, dtype=torch.uint8), scales, scales, 32)
    quant_matmul.int8_matmul(x, torch.empty(n, k, dtype=torch.int8), torch.empty(n, 1, dtype=torch.float16), k)
    quant_matmul.dequantize(torch.empty(n, k // 2, dtype=torch.uint8), scales, scales, 32, dtype)


def _resources(cubin: bytes, folder: Path) -> dict[str, int]:
    """REG (registers a thread), LOCAL (bytes a thread spills to local memory), SHARED, ... from cuobjdump."""
    path = folder / "kernel.cubin"
    path.write_bytes(cubin)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    line = next(line for line in usage.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in (part.split(":") for part in line.split()) if value.isdigit()}


def main() -> None:
    driver.set_active(_TargetOnly())
    launch = JITFunction.run
    case = {}

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        print(json.dumps({"kernel": self.fn.__name__, **case, **_resources(kernel.asm["cubin"], folder)}), flush=True)
        return kernel

    JITFunction.run = compile_only
    with TemporaryDirectory() as name:
        folder = Path(name)
        for dtype in DTYPES:
            for model, shape in SHAPES.items():
                case.update(model=model, dtype=str(dtype))
                _layer_kernels(dtype, *shape)
            for rows in (1, 64):
                case.update(model=f"int4/int8 weights, {rows} rows", dtype=str(dtype))
                if dtype != torch.float32:  # float32 activations take cuBLAS on a float32 weight
                    _quantized_kernels(dtype, rows)


if __name__ == "__main__":
    sys.exit(main())
