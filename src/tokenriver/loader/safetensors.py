"""Hugging Face model folder (config.json + *.safetensors) → ModelConfig and weight tensors.

Reads config.json as written by transformers 4.x (`rope_theta`, `rope_scaling`)
or 5.x (`rope_parameters`), and the weights from one model.safetensors or the
shards listed in model.safetensors.index.json. Parameter names are already
Hugging Face's, which is what the models use; only families whose checkpoints
name them otherwise are renamed (loader/hf_arch.py). sentence-transformers' files
beside config.json give the pooling (loader/embedding_files.py).
Only safetensors are read: pickle-based checkpoints (pytorch_model.bin) can run
code when loaded and are refused.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tokenriver.errors import ModelLoadError
from tokenriver.loader.embedding_files import read_pooling
from tokenriver.loader.hf_arch import (
    encoder_weights,
    family_fields,
    hidden_act,
    rename_weights,
    standard_keys,
    supported_activations,
)
from tokenriver.models.config import ModelConfig
from tokenriver.models.registry import canonical_architecture

_INDEX_FILE = "model.safetensors.index.json"


@dataclass
class HFCheckpoint:
    """Everything tokenriver takes from a Hugging Face folder, besides the tokenizer files."""

    config: ModelConfig
    # Hugging Face parameter name → tensor in the requested dtype, on CPU.
    weights: dict[str, torch.Tensor]


def read_hf_folder(path: str, dtype: torch.dtype = torch.float32) -> HFCheckpoint:
    """Parse config.json and read every safetensors shard; ModelLoadError says what is missing or wrong."""
    config = read_hf_config(path)
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        try:
            with safe_open(file, framework="pt") as shard:
                for name in shard.keys():
                    weights[name] = shard.get_tensor(name).to(dtype)
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(
                f"{file}: cannot read this safetensors file ({error}); download it again", path=file
            ) from error
    weights = rename_weights(config.architecture, weights)
    weights = encoder_weights(config, weights)
    # Older checkpoints store the rotary frequencies; ours are computed from the config.
    weights = {name: w for name, w in weights.items() if not name.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    elif "lm_head.weight" not in weights and config.is_causal:
        raise ModelLoadError(
            f"{path}: config.json says tie_word_embeddings is false but the safetensors files "
            f"have no lm_head.weight; the checkpoint is incomplete",
            path=path,
        )
    return HFCheckpoint(config=config, weights=weights)


def read_hf_config(path: str) -> ModelConfig:
    """config.json → ModelConfig."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(
            f"{path}: no config.json in this folder; a Hugging Face model folder needs config.json "
            f"and *.safetensors (or pass a .gguf file instead)",
            path=path,
        )
    try:
        with open(config_path, encoding="utf-8") as file:
            raw = json.load(file)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{config_path}: not valid JSON ({error})", path=config_path) from error
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_path}: expected a JSON object of model settings", path=config_path)
    try:
        return _to_model_config(config_path, raw)
    except ModelLoadError as error:
        raise ModelLoadError(
            error.message if error.path else f"{config_path}: {error.message}", path=config_path
        ) from error
    except KeyError as error:
        raise ModelLoadError(
            f"{config_path}: the setting {error.args[0]!r} is missing; the file does not describe a complete model",
            path=config_path,
        ) from error
    except (TypeError, ValueError) as error:
        raise ModelLoadError(
            f"{config_path}: a setting has the wrong type ({error}); the file does not describe a supported model",
            path=config_path,
        ) from error


def _to_model_config(config_path: str, raw: dict[str, Any]) -> ModelConfig:
    names = raw.get("architectures") or [raw.get("model_type")]
    if not names or not isinstance(names[0], str):
        raise ModelLoadError(
            f"{config_path}: neither 'architectures' nor 'model_type' says which model this is", path=config_path
        )
    architecture = canonical_architecture(names[0], config_path)
    raw = standard_keys(architecture, raw)
    activation = hidden_act(architecture, raw)
    if activation not in supported_activations(architecture):
        raise ModelLoadError(
            f"{config_path}: hidden_act={activation!r} is not supported for {architecture} "
            f"(supported: {', '.join(supported_activations(architecture))})",
            path=config_path,
        )
    if raw.get("mlp_bias", False):
        raise ModelLoadError(f"{config_path}: mlp_bias=true is not supported", path=config_path)
    num_heads = raw["num_attention_heads"]
    has_llama_bias = architecture == "llama" and bool(raw.get("attention_bias", False))
    max_positions = raw["max_position_embeddings"]
    window = _sliding_window(architecture, raw)
    if window is not None:
        # Tokenriver attends to the whole context, which equals sliding-window attention only while the
        # sequence fits the window: cap the context there so results stay exact.
        max_positions = min(max_positions, window)
    rope_theta, rope_scaling = _rope(raw)
    values: dict[str, Any] = dict(
        architecture=architecture,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=architecture == "qwen2" or has_llama_bias,
        attention_out_bias=has_llama_bias,
        name=raw.get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(config_path))),
    )
    values.update(family_fields(architecture, raw, config_path))
    values["pooling"], values["normalize"] = read_pooling(os.path.dirname(config_path))
    return ModelConfig(**values)


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope theta and scaling from transformers 5 `rope_parameters` or 4.x `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return rope_theta, None
    return rope_theta, {"rope_type": rope_type, **params}


def _sliding_window(architecture: str, raw: dict[str, Any]) -> int | None:
    """The attention window the model was trained with, if it has one."""
    if architecture == "mistral":
        return raw.get("sliding_window")
    if architecture == "qwen2" and raw.get("use_sliding_window"):
        return raw.get("sliding_window")
    return None


def _safetensors_files(path: str) -> list[str]:
    """The shards named by the index, or every *.safetensors file in the folder."""
    index_path = os.path.join(path, _INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as file:
                shard_names = sorted(set(json.load(file)["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
            raise ModelLoadError(
                f"{index_path}: malformed index ({error!r}); it needs a weight_map of parameter name → shard file",
                path=index_path,
            ) from error
        files = [os.path.join(path, name) for name in shard_names]
        missing = [name for name, file in zip(shard_names, files) if not os.path.isfile(file)]
        if missing:
            raise ModelLoadError(
                f"{path}: shards listed in {_INDEX_FILE} are missing: {', '.join(missing)}; download them too",
                path=path,
            )
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        return files
    pickled = [
        os.path.basename(f)
        for pattern in ("*.bin", "*.pt", "*.pth", "*.ckpt")
        for f in glob.glob(os.path.join(path, pattern))
    ]
    if pickled:
        raise ModelLoadError(
            f"{path}: only pickle-based weights here ({', '.join(sorted(pickled))}); tokenriver "
            f"never unpickles model files because loading them can run arbitrary code. Convert "
            f"them to safetensors (e.g. save_pretrained(..., safe_serialization=True)) or use "
            f"a GGUF file",
            path=path,
        )
    raise ModelLoadError(f"{path}: no *.safetensors weights in this folder", path=path)
