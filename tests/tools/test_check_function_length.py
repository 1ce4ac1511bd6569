"""tools/check_function_length.py: a function over a screen fails, one that fits passes."""

import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_function_length.py"


@pytest.fixture(scope="module")
def checker():
    spec = importlib.util.spec_from_file_location("check_function_length", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def function(name: str, num_lines: int, indent: str = "") -> str:
    """A function of exactly num_lines lines, its def included."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(num_lines - 2))
    return f"{indent}def {name}():\n{body}{indent}    return 0\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "module.py"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_function_that_fits_passes(checker, tmp_path):
    path = write(tmp_path, function("short", checker.MAX_LINES))
    assert checker.find_problems(path) == []
    assert checker.main([str(path)]) == 0


def test_a_longer_function_fails_naming_it(checker, tmp_path):
    path = write(tmp_path, "x = 1\n\n" + function("long", checker.MAX_LINES + 1))
    [(line, message)] = checker.find_problems(path)
    assert line == 3 and message.startswith(f"long has {checker.MAX_LINES + 1} lines")
    assert checker.main([str(path)]) == 1


def test_decorators_count_and_methods_are_named_by_their_class(checker, tmp_path):
    method = function("step", checker.MAX_LINES, indent="    ")
    path = write(tmp_path, "class Engine:\n    @staticmethod\n" + method)
    [(line, message)] = checker.find_problems(path)
    assert line == 2 and message.startswith("Engine.step has")


def test_a_nested_function_counts_on_its_own_too(checker, tmp_path):
    inner = function("inner", checker.MAX_LINES + 1, indent="    ")
    path = write(tmp_path, "def outer():\n" + inner + "    return inner\n")
    names = sorted(message.split()[0] for _, message in checker.find_problems(path))
    assert names == ["outer", "outer.inner"]


def test_src_fits(checker):
    assert checker.main([str(TOOL.parents[1] / "src")]) == 0
