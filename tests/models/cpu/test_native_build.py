"""The native kernels compile for each x86-64 level they have code paths for: AVX2 alone (Haswell), AVX-512
without VNNI (Skylake-X), with VNNI (Ice Lake) and with BF16 too (Cooper Lake). The machine the tests run on
builds and runs only its own level, so a path it does not take is compiled here (syntax and types only). A build
that fails for a passing reason (a compiler killed by a signal, a failed fork) is tried again; a compile error is not,
and the warning says the process's greedy text changes."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tokenriver.models.cpu import kernels
from tokenriver.models.cpu.kernels import COMPILE_FLAGS, SOURCES, load_kernels

COMPILER = shutil.which("g++")


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler")
@pytest.mark.parametrize("march", ["haswell", "skylake-avx512", "icelake-server", "cooperlake"])
def test_the_kernels_compile_for_each_instruction_set(march):
    flags = [flag for flag in COMPILE_FLAGS if flag not in ("-march=native", "-shared", "-O3")]
    result = subprocess.run(
        [COMPILER, f"-march={march}", *flags, "-fsyntax-only", *map(str, SOURCES)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture
def fresh_load(monkeypatch):
    """load_kernels() uncached for the test, and loaded again from the real build after it."""
    load_kernels.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    load_kernels.cache_clear()
    assert load_kernels() is not None


def _failing_build(failures: list[BaseException]):
    real = kernels._build

    def build(compiler, flags):
        if failures:
            raise failures.pop(0)
        return real(compiler, flags)

    return build


@pytest.mark.skipif(load_kernels() is None, reason="native kernels do not build on this machine")
def test_a_compiler_killed_on_a_busy_machine_is_retried(fresh_load):
    killed = subprocess.CalledProcessError(-9, ["c++"], stderr="")
    failures: list[BaseException] = [killed, OSError(12, "Cannot allocate memory")]
    fresh_load.setattr(kernels, "_build", _failing_build(failures))
    assert load_kernels() is not None
    assert failures == []


@pytest.mark.skipif(load_kernels() is None, reason="native kernels do not build on this machine")
def test_a_compile_error_is_not_retried_and_says_what_changes(fresh_load, caplog):
    failures: list[BaseException] = [subprocess.CalledProcessError(1, ["c++"], stderr="vec.h:1: error: nope")] * 3
    fresh_load.setattr(kernels, "_build", _failing_build(failures))
    with caplog.at_level("WARNING", logger=kernels.logger.name):
        assert load_kernels() is None
    assert len(failures) == 2
    assert "vec.h:1: error: nope" in caplog.text and "greedy text differs" in caplog.text
