"""Shared fixtures: the embedded model loaded once per test session, and the transformers reference."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels (models/cuda) run in Triton's interpreter, on CPU tensors. Triton reads this
    # when it is first imported (its own library functions, tl.sum among them, are made then), so it is set here,
    # before any test imports it.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked cuda skip, saying why, where PyTorch sees no GPU (CI); benchmarks/gpu_check.sh runs them."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `pytest -m cuda` (or benchmarks/gpu_check.sh) on one")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # not item.keywords: that holds folder names too
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from tokenriver.loader.load import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def loaded_float32(default_model_path):
    """The embedded model dequantized to float32 (the transformers reference's numbers), shared by engine tests."""
    from tokenriver.loader.load import load_model

    return load_model(default_model_path, dtype="float32", quantization="none")


@pytest.fixture(scope="session")
def loaded_packed(default_model_path):
    """The embedded model with its Q4_1 / Q8_0 weights kept packed (native kernels) and float32 activations."""
    from tokenriver.loader.load import load_model

    return load_model(default_model_path, quantization="auto")


@pytest.fixture(scope="session")
def loaded_default(default_model_path):
    """The embedded model exactly as `LLM()` loads it: packed weights and int8-rounded activations (and so, in the
    engine, an int8 KV pool)."""
    from tokenriver.loader.load import load_model

    return load_model(default_model_path, int8_activations=None)


@pytest.fixture(scope="session")
def hf_reference(default_model_path):
    """transformers' model and tokenizer on the same GGUF: the reference for correctness."""
    transformers = pytest.importorskip("transformers")
    directory, name = os.path.split(default_model_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()
    return model, tokenizer
