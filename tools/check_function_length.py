"""Fail when a Python function under src/ is longer than a screen (MAX_LINES lines).

A function that reads in one screen can be checked in one reading; a longer one hides a second idea that wants a name
of its own. A function's lines run from its `def` (or its first decorator) to its last line, docstring, comments and
blank lines included: what a reader scrolls through. Nested functions count inside the function that holds them, and
once more on their own.
Usage: python tools/check_function_length.py [PATH ...]   (default: src)
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

MAX_LINES = 80


def long_functions(source: str, max_lines: int = MAX_LINES) -> Iterator[tuple[int, str, int]]:
    """Yield (line, qualified name, length) for every function of `source` longer than max_lines lines."""
    pending: list[tuple[str, ast.AST]] = [("", ast.parse(source))]
    while pending:
        prefix, node = pending.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno] + [decorator.lineno for decorator in child.decorator_list])
                    length = (child.end_lineno or child.lineno) - first + 1
                    if length > max_lines:
                        yield first, name, length
                pending.append((name + ".", child))
            else:
                pending.append((prefix, child))


def find_problems(path: Path) -> list[tuple[int, str]]:
    """Return (line, message) for each function of `path` over the limit."""
    try:
        found = list(long_functions(path.read_text(encoding="utf-8")))
    except SyntaxError as error:  # the checker cannot vouch for a file it cannot read
        return [(error.lineno or 0, f"cannot parse the file: {error}")]
    return [(line, f"{name} has {length} lines (at most {MAX_LINES}): split it") for line, name, length in found]


def iter_files(roots: list[Path]) -> Iterator[Path]:
    for root in roots:
        if root.is_file():
            yield root
        else:
            yield from sorted(root.rglob("*.py"))


def main(argv: list[str]) -> int:
    roots = [Path(arg) for arg in argv] or [Path("src")]
    failures = [(path, line, text) for path in iter_files(roots) for line, text in find_problems(path)]
    for path, line, text in failures:
        print(f"{path}:{line}: {text}")
    if failures:
        print(f"{len(failures)} problem(s): a function reads in one screen ({MAX_LINES} lines); name its parts.")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
