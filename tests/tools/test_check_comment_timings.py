"""tools/check_comment_timings.py: a timing figure in a comment or docstring fails, the same figure in code does not."""

import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_comment_timings.py"


@pytest.fixture(scope="module")
def checker():
    spec = importlib.util.spec_from_file_location("check_comment_timings", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "name, text, line",
    [
        ("comment.py", "x = 1\n# this took 3.5 ms on my machine\n", 2),
        ("docstring.py", 'def f():\n    """Fast.\n\n    Decodes at 1,369 tokens/s.\n    """\n', 4),
        ("module.py", '"""Streams at 15-20 GB/s."""\n', 1),
        ("micro.py", "y = 2  # 17 µs per call\n", 1),
        ("line.cpp", "int x;  // an RMSNorm of 32 rows took 17us\n", 1),
        ("block.h", "/* Prefetching:\n   2.78 against 3.18 ms. */\nint y;\n", 2),
    ],
)
def test_timing_in_a_comment_fails(checker, tmp_path, name, text, line):
    path = write(tmp_path, name, text)
    assert [found for found, _ in checker.find_timings(path)] == [line]
    assert checker.main([str(path)]) == 1


@pytest.mark.parametrize(
    "name, text",
    [
        (
            "clean.py",
            '"""Why: the GEMV is bound by reading weights (benchmarks/results/kernels.md)."""\n'
            "TIMEOUT_MS = 50  # the limit, in milliseconds\nlabel = '3 ms'\n",
        ),
        (
            "clean.cpp",
            'const char* unit = "3 ms";  // a string literal is code, not a comment\n'
            "// 16 rows a tile: one FMA per column and row (see gemm.md).\n",
        ),
    ],
)
def test_clean_file_passes(checker, tmp_path, name, text):
    path = write(tmp_path, name, text)
    assert checker.find_timings(path) == []
    assert checker.main([str(path)]) == 0


def test_src_is_clean(checker):
    assert checker.main([str(TOOL.parents[1] / "src")]) == 0


def test_unparsable_file_fails_with_a_message(checker, tmp_path, capsys):
    path = write(tmp_path, "conflict.py", "x = 1\n<<<<<<< ours\ny = 2\n")
    assert checker.main([str(path)]) == 1
    assert "cannot parse" in capsys.readouterr().out
