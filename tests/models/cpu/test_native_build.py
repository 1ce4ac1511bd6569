"""The native kernels compile for each x86-64 level they have code paths for: AVX2 alone (Haswell), AVX-512
without VNNI (Skylake-X), with VNNI (Ice Lake) and with BF16 too (Cooper Lake). The machine the tests run on
builds and runs only its own level, so a path it does not take is compiled here (syntax and types only)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tokenriver.models.cpu.kernels import COMPILE_FLAGS, SOURCES

COMPILER = shutil.which("g++")


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler")
@pytest.mark.parametrize("march", ["haswell", "skylake-avx512", "icelake-server", "cooperlake"])
def test_the_kernels_compile_for_each_instruction_set(march):
    flags = [flag for flag in COMPILE_FLAGS if flag not in ("-march=native", "-shared", "-O3")]
    result = subprocess.run(
        [COMPILER, f"-march={march}", *flags, "-fsyntax-only", *map(str, SOURCES)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
