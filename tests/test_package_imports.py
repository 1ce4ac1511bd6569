"""`import tokenriver` imports nothing beyond itself, and the scheduler stays plain Python: each checked in a fresh
interpreter, since this test process has long imported torch."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

import tokenriver


def _modules_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return set(result.stdout.split())


def test_importing_the_scheduler_does_not_import_torch():
    modules = _modules_after("import tokenriver.sched.scheduler")
    assert "tokenriver.sched.scheduler" in modules
    assert "torch" not in modules and "numpy" not in modules


def test_importing_the_package_imports_no_submodule_and_leaves_gc_alone():
    code = (
        "import gc, sys; gc.set_threshold(1234); import tokenriver; "
        "print(gc.isenabled(), gc.get_threshold()[0], gc.get_freeze_count(), "
        "sorted(m for m in sys.modules if m.startswith('tokenriver')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.split(" ", 3)[:3] == ["True", "1234", "0"]
    assert result.stdout.strip().endswith("['tokenriver']")


def test_public_names_resolve_on_first_use():
    assert tokenriver.SamplingParams.__module__ == "tokenriver.params"
    assert tokenriver.LLM.__name__ == "LLM" and "LLM" in dir(tokenriver)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        tokenriver.nothing  # noqa: B018
    assert gc.isenabled()


def test_the_offline_path_imports_no_library_it_does_not_use():
    """LLM() loads the embedded model and builds the engine: no web server, no chat templates (jinja2), no grammar
    engine (llguidance, on the first constrained request), no safetensors (a folder's format) and no transformers."""
    modules = _modules_after("from tokenriver import LLM; LLM()")
    unused = ("fastapi", "pydantic", "uvicorn", "jinja2", "llguidance", "safetensors", "transformers")
    assert not [name for name in unused if name in modules]
