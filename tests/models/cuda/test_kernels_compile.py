"""Every Triton kernel of models/cuda compiled for an H100 (sm_90) down to its cubin, without a GPU.

The interpreter (the other tests here, without a GPU) runs a kernel's Python on NumPy: it checks what the kernel
computes, not that Triton's compiler accepts it. A type the compiler infers differently, a reshape or a loop it
rejects, bfloat16 (which the interpreter lacks), or a tile too large for a thread's registers would first fail on a
GPU. h100_compile.py compiles each kernel with Triton's own compiler and ptxas for the shapes and dtypes the engine
hands it (several models' layers, three dtypes) and reads back each cubin's resource use.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

LAYER_KERNELS = {
    "_rms_norm_kernel",
    "_rotary_kernel",
    "_gated_kernel",
    "_write_kv_kernel",
    "_decode_kernel",
    "_merge_kernel",
}
QUANTIZED_KERNELS = {"_quant_matmul_kernel", "_dequantize_kernel"}
# Bytes of stack a thread may use: registers saved outside the loops, not spilled tiles.
MAX_STACK_BYTES = 64


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> list[dict]:
    """One line per kernel launch compiled: kernel, model, dtype and the cubin's resources (REG, LOCAL, ...)."""
    pytest.importorskip("triton", reason="triton is not installed: the CUDA kernels' compilation is untested")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))  # compiled here, not read from a cache
    script = Path(__file__).with_name("h100_compile.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_every_kernel_compiles_for_every_model_and_dtype(compiled):
    cases: dict[tuple[str, str], set[str]] = {}
    for launch in compiled:
        cases.setdefault((launch["model"], launch["dtype"]), set()).add(launch["kernel"])
    layer_cases = {case: kernels for case, kernels in cases.items() if not case[0].startswith("int4")}
    assert len(layer_cases) == 15
    assert all(kernels == LAYER_KERNELS for kernels in layer_cases.values()), layer_cases
    quantized = [kernels for case, kernels in cases.items() if case[0].startswith("int4")]
    assert len(quantized) == 4 and all(kernels == QUANTIZED_KERNELS for kernels in quantized)


def test_the_script_covers_every_kernel_of_the_package(compiled):
    """A kernel added to models/cuda must be added to h100_compile.py too."""
    import tokenriver.models.cuda as package

    sources = "".join(path.read_text() for path in Path(package.__file__).parent.glob("*.py"))
    launched = set(re.findall(r"@triton\.jit\s+def (\w+_kernel)\(", sources))
    assert launched == LAYER_KERNELS | QUANTIZED_KERNELS
    assert {launch["kernel"] for launch in compiled} == launched


def test_no_kernel_spills_its_tiles(compiled):
    """A thread that needs more than its 255 registers keeps values on its stack, in off-chip memory: a tile that
    does not fit spills kilobytes and reloads them every loop iteration. Tiles are sized (paged_decode's
    TILE_ELEMENTS, quant_matmul.choose_blocks) so that none does; a few registers saved once (the decode kernel's
    8 or 16 bytes a thread) are harmless."""
    spilled = [launch for launch in compiled if launch["STACK"] > MAX_STACK_BYTES or launch["LOCAL"] > 0]
    assert not spilled, spilled
    assert all(0 < launch["REG"] <= 255 for launch in compiled)
