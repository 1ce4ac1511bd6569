"""load_tokenizer: a model's tokenizer without its weights.

A front end that only tokenizes (the Ray Serve ingress hashes prompts to route them) needs the vocabulary, not
the tensors: a GGUF file's header (cached index, then memory-mapped) or a folder's tokenizer files.
"""

from __future__ import annotations

import os

from tokenriver.errors import ModelLoadError
from tokenriver.loader.gguf import read_tokenizer_fields
from tokenriver.loader.load import default_model_path
from tokenriver.loader.tokenizer_files import tokenizer_from_folder, tokenizer_from_gguf_fields
from tokenriver.tokenizer.tokenizer import Tokenizer


def load_tokenizer(path: str | None = None, cache_dir: str | None = None) -> Tokenizer:
    """The tokenizer of a .gguf file or Hugging Face folder (None = the default model), as load_model builds it."""
    path = default_model_path() if path is None else os.fspath(path)
    if os.path.isdir(path):
        return tokenizer_from_folder(path)
    if not os.path.isfile(path):
        raise ModelLoadError(
            f"{path}: no such file or folder; pass a .gguf file or a Hugging Face model folder", path=path
        )
    try:
        return tokenizer_from_gguf_fields(read_tokenizer_fields(path, cache_dir), cache_dir)
    except ModelLoadError as error:
        raise ModelLoadError(f"{path}: {error.message}", path=path) from error
