"""What a Hugging Face folder says about embedding with its model, besides config.json.

- sentence-transformers' pipeline, `modules.json`: the model (a Transformer module), then a Pooling module whose
  config (`1_Pooling/config.json`) names how token vectors become one vector, and optionally a Normalize module
  (unit length). `read_pooling` turns that into ModelConfig's `pooling` and `normalize`, for every architecture
  (a causal embedding model pools the last token). A module that would change the vector further (Dense, ...) is
  refused: the engine would return other vectors than the model's authors.
- the [SEP] token's id, from which an encoder derives token types (models/bert.py): config.json's `sep_token_id`
  where it has one, else the `sep_token` the tokenizer files name, else "[SEP]".
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from tokenriver.errors import ModelLoadError

# Pooling config flags → ModelConfig.pooling.
_POOLING_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
# The same as sentence-transformers' `pooling_mode` names (a config may carry that string instead of the flags).
_POOLING_NAMES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
# sentence-transformers modules (by class name) that leave the pooled vector as ModelConfig describes it.
_KNOWN_MODULES = frozenset({"Transformer", "Pooling", "Normalize"})


def read_pooling(folder: str) -> tuple[str | None, bool | None]:
    """(pooling, normalize) from the folder's sentence-transformers files; (None, None) where it has none."""
    modules_path = os.path.join(folder, "modules.json")
    if not os.path.isfile(modules_path):
        return None, None
    modules = _read_json(modules_path)
    if not isinstance(modules, list) or not all(isinstance(module, dict) for module in modules):
        raise ModelLoadError(f"{modules_path}: expected a list of modules, each an object", path=modules_path)
    pooling, normalize = None, False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _KNOWN_MODULES:
            raise ModelLoadError(
                f"{modules_path}: the sentence-transformers module {module.get('type')!r} "
                f"({module.get('path') or 'no path'}) is not supported: tokenriver pools and normalizes, and a "
                f"module that changes the vector further would give other embeddings than the model's",
                path=modules_path,
            )
        if kind == "Pooling":
            pooling = _pooling_mode(os.path.join(folder, str(module.get("path", "")), "config.json"))
        normalize = normalize or kind == "Normalize"
    return pooling, normalize


def _pooling_mode(config_path: str) -> str | None:
    """The one pooling a Pooling module's config.json switches on, or None if it switches none on."""
    if not os.path.isfile(config_path):
        raise ModelLoadError(
            f"{config_path}: modules.json names a Pooling module, but its config is missing", path=config_path
        )
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_path}: expected a JSON object of pooling settings", path=config_path)
    if isinstance(config.get("pooling_mode"), str) and config["pooling_mode"] in _POOLING_NAMES:
        return _POOLING_NAMES[config["pooling_mode"]]
    flags = sorted(key for key, value in config.items() if key.startswith("pooling_mode_") and value is True)
    if not flags:
        return None
    if len(flags) > 1 or flags[0] not in _POOLING_FLAGS:
        raise ModelLoadError(
            f"{config_path}: {' + '.join(flags)} is not supported; tokenriver pools with one of "
            f"{', '.join(_POOLING_FLAGS)}",
            path=config_path,
        )
    return _POOLING_FLAGS[flags[0]]


def sep_token_id(folder: str, raw: dict[str, Any]) -> int | None:
    """The [SEP] id of an encoder folder: config.json's, else the tokenizer's `sep_token` (or "[SEP]"), else None."""
    if isinstance(raw.get("sep_token_id"), int):
        return raw["sep_token_id"]
    tokenizer_path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(tokenizer_path):
        return None
    names = [_named_token(folder, "tokenizer_config.json"), _named_token(folder, "special_tokens_map.json"), "[SEP]"]
    try:
        tokenizer = BackendTokenizer.from_file(tokenizer_path)
    except Exception as error:  # the Rust loader raises a bare Exception on malformed JSON
        raise ModelLoadError(f"{tokenizer_path} is not a valid tokenizer.json: {error}", path=tokenizer_path) from error
    ids = [tokenizer.token_to_id(name) for name in names if name is not None]
    return next((token_id for token_id in ids if token_id is not None), None)


def _named_token(folder: str, name: str) -> str | None:
    """The sep_token a tokenizer file names (a string, or an AddedToken object with "content"), if any."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    value = _read_json(path)
    token = value.get("sep_token") if isinstance(value, dict) else None
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{path}: not valid JSON ({error})", path=path) from error
