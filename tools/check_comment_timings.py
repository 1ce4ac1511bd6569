"""Fail when a comment or docstring under src/ quotes a timing figure.

Comments say why the code is the way it is; how fast it ran on one machine on one day belongs in
benchmarks/results/ (linked from the comment) and benchmarks/HISTORY.md, where it can be re-measured.
Checked: Python comments and docstrings (module, class and function), and C++ `//` and `/* */` comments.
Usage: python tools/check_comment_timings.py [PATH ...]   (default: src)
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

# A number, then a unit of time or of speed: "3.2 ms", "17µs", "1,369 tokens/s", "15-20 GB/s".
TIMING = re.compile(r"\d(?:[\d,.]*\d)?\s*(?:ms|µs|us|ns|tokens?/s|tok/s|[GMK]B/s|GFLOP/s)(?![A-Za-z])")
PYTHON_SUFFIXES = {".py"}
CPP_SUFFIXES = {".cpp", ".h", ".hpp", ".cc"}


def python_comments(source: str) -> Iterator[tuple[int, str]]:
    """Yield (line, text) for every comment and docstring of a Python source."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                value = body[0].value.value
                if isinstance(value, str):
                    for offset, line in enumerate(value.splitlines()):
                        yield body[0].lineno + offset, line


def cpp_comments(source: str) -> Iterator[tuple[int, str]]:
    """Yield (line, text) for every line of every // and /* */ comment, skipping string and char literals."""
    i, line, n = 0, 1, len(source)
    while i < n:
        ch = source[i]
        if ch == "\n":
            line += 1
            i += 1
        elif source.startswith("//", i):
            end = source.find("\n", i)
            end = n if end == -1 else end
            yield line, source[i:end]
            i = end
        elif source.startswith("/*", i):
            end = source.find("*/", i + 2)
            end = n if end == -1 else end + 2
            for offset, text in enumerate(source[i:end].split("\n")):
                yield line + offset, text
            line += source.count("\n", i, end)
            i = end
        elif ch in "\"'":
            i += 1
            while i < n and source[i] != ch and source[i] != "\n":
                i += 2 if source[i] == "\\" else 1
            i += 1
        else:
            i += 1


def find_timings(path: Path) -> list[tuple[int, str]]:
    """Return (line, comment text) for each comment line of `path` that quotes a timing figure."""
    source = path.read_text(encoding="utf-8")
    if path.suffix in PYTHON_SUFFIXES:
        comments = python_comments(source)
    elif path.suffix in CPP_SUFFIXES:
        comments = cpp_comments(source)
    else:
        return []
    try:
        return [(line, f"timing figure in a comment: {text.strip()}") for line, text in comments if TIMING.search(text)]
    except (SyntaxError, tokenize.TokenError) as error:  # the checker cannot vouch for a file it cannot read
        return [(getattr(error, "lineno", None) or 0, f"cannot parse the file: {error}")]


def iter_files(roots: list[Path]) -> Iterator[Path]:
    for root in roots:
        if root.is_file():
            yield root
        else:
            yield from sorted(p for p in root.rglob("*") if p.suffix in PYTHON_SUFFIXES | CPP_SUFFIXES)


def main(argv: list[str]) -> int:
    roots = [Path(arg) for arg in argv] or [Path("src")]
    failures = [(path, line, text) for path in iter_files(roots) for line, text in find_timings(path)]
    for path, line, text in failures:
        print(f"{path}:{line}: {text}")
    if failures:
        print(
            f"{len(failures)} problem(s): comments say why; put the figures in "
            "benchmarks/results/ (or benchmarks/HISTORY.md) instead."
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
