"""Start-up costs load_model avoids: importing torch._dynamo for meta-device init, and leaving the thread count
changed after loading on one thread."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import tokenriver
from tokenriver.loader.load import load_model


def test_loading_the_default_model_does_not_import_dynamo(tmp_path):
    """nn.Embedding's normal_ on a meta tensor would import torch._dynamo and sympy (1.5-2.5 s); a fresh
    interpreter shows whether a load pulls them in."""
    code = (
        "import sys; from tokenriver.loader.load import load_model; load_model(); "
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))"
    )
    source_root = os.path.dirname(os.path.dirname(tokenriver.__file__))
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=source_root)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_load_model_restores_the_thread_count(default_model_path, tmp_path):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        loaded = load_model(default_model_path, cache_dir=str(tmp_path))
        assert torch.get_num_threads() == 2
        # Meta parameters were skipped, never left uninitialized: every tensor holds the file's values.
        assert not any(t.is_meta for t in [*loaded.model.parameters(), *loaded.model.buffers()])
    finally:
        torch.set_num_threads(before)
