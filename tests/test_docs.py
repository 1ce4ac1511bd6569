"""The code blocks of README.md and docs/*.md run, so that the documentation cannot drift from the code.

- `python` blocks of one file run in order in one namespace (a later block may use an earlier one's `llm`),
  in this process, against the embedded model.
- `bash` / `sh` / `shell` blocks run line by line as subprocesses: `tokenriver ARGS` as
  `python -m tokenriver.cli ARGS`, `python` as this interpreter. Any other command fails the test.
- A block that starts a server, needs one, installs packages or takes long is preceded by a marker with a reason,
  `<!-- docs-test: skip (reason) -->`; it is reported as skipped, with that reason. Blocks in other languages
  (`text`, `json`, no language) are not code to run.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = ("python", "py")
SHELL = ("bash", "sh", "shell")
SKIP_MARKER = re.compile(r"^<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
ANY_MARKER = re.compile(r"^<!--\s*docs-test:")  # at the start of a line: an indented one is an example
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
SHELL_TIMEOUT = 300


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip_reason: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def extract_blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown file, with the skip marker (if any) on the last non-blank line before it.

    A marker that is not right before a block, or that gives no reason, is an error: skips are never silent.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    pending: tuple[int, str] | None = None  # (line, reason) of a skip marker waiting for its block
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise AssertionError(f"{path.name}:{i + 1}: code block never closed")
            blocks.append(
                Block(
                    path,
                    i + 1,
                    fence["lang"].lower(),
                    "\n".join(lines[i + 1 : end]) + "\n",
                    pending[1] if pending else None,
                )
            )
            pending = None
            i = end + 1
            continue
        if ANY_MARKER.match(line):
            marker = SKIP_MARKER.match(line)
            if marker is None:
                raise AssertionError(f"{path.name}:{i + 1}: write the marker as <!-- docs-test: skip (reason) -->")
            if pending is not None:
                raise AssertionError(f"{path.name}:{pending[0]}: skip marker not followed by a code block")
            pending = (i + 1, marker["reason"].strip())
        elif line.strip() and pending is not None:
            raise AssertionError(f"{path.name}:{pending[0]}: skip marker not right before a code block")
        i += 1
    if pending is not None:
        raise AssertionError(f"{path.name}:{pending[0]}: skip marker not followed by a code block")
    return blocks


def blocks_of(langs: tuple[str, ...]) -> list[Block]:
    return [block for path in DOC_FILES for block in extract_blocks(path) if block.lang in langs]


def shell_commands(code: str) -> list[list[str]]:
    """The block's commands as argument lists: backslash continuations joined, comments and blank lines dropped."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if argv and argv[0] == "$":
            argv = argv[1:]
        if argv:
            commands.append(argv)
    return commands


def runnable(argv: list[str]) -> list[str]:
    if argv[0] == "tokenriver":
        return [sys.executable, "-m", "tokenriver.cli", *argv[1:]]
    if argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    raise AssertionError(
        f"{argv[0]!r} is not a command the docs test runs: mark the block "
        f"<!-- docs-test: skip (reason) --> or use `tokenriver` / `python`"
    )


# One namespace per markdown file for its Python blocks; dropped after the file's last block.
_namespaces: dict[Path, dict] = {}


def _last_python_block(path: Path) -> int:
    return max(block.line for block in extract_blocks(path) if block.lang in PYTHON)


def test_every_doc_file_parses_and_markers_sit_on_blocks():
    for path in DOC_FILES:
        extract_blocks(path)
    assert (ROOT / "README.md") in DOC_FILES and len(DOC_FILES) > 1


@pytest.mark.parametrize("block", blocks_of(PYTHON), ids=lambda block: block.id)
def test_python_block(block: Block):
    if block.skip_reason:
        pytest.skip(f"{block.id}: {block.skip_reason}")
    namespace = _namespaces.setdefault(block.path, {"__name__": "__docs__"})
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(block.code, block.id, "exec"), namespace)  # noqa: S102 - the docs' own code
    finally:
        if block.line == _last_python_block(block.path):
            _namespaces.pop(block.path, None)
            gc.collect()


@pytest.mark.parametrize("block", blocks_of(SHELL), ids=lambda block: block.id)
def test_shell_block(block: Block):
    if block.skip_reason:
        pytest.skip(f"{block.id}: {block.skip_reason}")
    commands = shell_commands(block.code)
    assert commands, f"{block.id}: empty shell block"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    for argv in commands:
        result = subprocess.run(
            runnable(argv),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=SHELL_TIMEOUT,
        )
        assert result.returncode == 0, (
            f"{block.id}: `{shlex.join(argv)}` exited with {result.returncode}:\n"
            f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        )


READ_THE_CODE_ROW = re.compile(r"^\|\s*\d+\s*\|\s*`(?P<path>[^`]+)`\s*\|\s*(?P<lines>\d+)\s*\|")


def test_read_the_code_line_counts_are_current():
    """The README's reading order gives each file's `wc -l`; a file that moved or grew must be updated there."""
    rows = [READ_THE_CODE_ROW.match(line) for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()]
    rows = [row for row in rows if row]
    assert len(rows) >= 5, "README.md lost its 'Read the code' table"
    stale = []
    for row in rows:
        path = ROOT / row["path"]
        actual = path.read_bytes().count(b"\n") if path.exists() else None
        if actual != int(row["lines"]):
            stale.append(
                f"{row['path']}: README says {row['lines']} lines, "
                f"{'the file does not exist' if actual is None else f'wc -l says {actual}'}"
            )
    assert not stale, "README.md 'Read the code' is out of date:\n" + "\n".join(stale)


MARKDOWN_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


@pytest.mark.parametrize(
    "path",
    [*DOC_FILES, ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "HISTORY.md"],
    ids=lambda path: str(path.relative_to(ROOT)),
)
def test_relative_links_resolve(path: Path):
    missing = []
    for match in MARKDOWN_LINK.finditer(path.read_text(encoding="utf-8")):
        target = match["target"].split("#", 1)[0]
        if not target or re.match(r"^[a-z]+:", target):
            continue
        if not (path.parent / target).exists():
            missing.append(match["target"])
    assert not missing, f"{path.name} links to files that do not exist: {missing}"


CODE_PATH = re.compile(r"`(?P<path>[\w./-]+(?:\.(?:py|cpp|h|md|toml|png)|/))`")
PATH_BASES = [ROOT, ROOT / "src", ROOT / "src" / "tokenriver", ROOT / "src" / "tokenriver" / "models"]


def _names_a_file(path: str) -> bool:
    if "/" not in path.rstrip("/"):  # a bare file name: it must exist somewhere in the project's code
        return any(ROOT.glob(f"src/**/{path}")) or any(ROOT.glob(f"*/{path}")) or (ROOT / path).exists()
    return any((base / path).exists() for base in PATH_BASES)


@pytest.mark.parametrize(
    "path", [*DOC_FILES, ROOT / "benchmarks" / "README.md"], ids=lambda path: str(path.relative_to(ROOT))
)
def test_code_paths_named_in_docs_exist(path: Path):
    """A file the docs name in backticks (`engine/core.py`, `gemm.cpp`) exists: moved code cannot leave docs behind."""
    text = path.read_text(encoding="utf-8")
    missing = sorted(
        {
            m["path"]
            for m in CODE_PATH.finditer(text)
            if not m["path"].startswith(("path/", "http")) and not _names_a_file(m["path"])
        }
    )
    assert not missing, f"{path.name} names files that do not exist: {missing}"
