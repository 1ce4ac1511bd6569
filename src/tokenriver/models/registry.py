"""Which model class runs which architecture name.

Keys are the names files use: GGUF `general.architecture` ("llama", "qwen2")
and Hugging Face config.json `architectures` / `model_type`
("LlamaForCausalLM", "mistral", ...). Loaders resolve a name once, here, and
store the canonical key in ModelConfig.architecture. A new architecture is one
more model file, a line in ARCHITECTURES and, for Hugging Face folders, its
class name in _ALIASES.
"""

from __future__ import annotations

from torch import nn

from tokenriver.errors import ModelLoadError
from tokenriver.models.bert import BertForPooling, XLMRobertaForPooling
from tokenriver.models.gemma import GemmaForCausalLM
from tokenriver.models.llama import LlamaForCausalLM
from tokenriver.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from tokenriver.models.nomic_bert import NomicBertForPooling
from tokenriver.models.phi3 import Phi3ForCausalLM
from tokenriver.models.qwen3 import Qwen3ForCausalLM

# Canonical architecture key → model class.
ARCHITECTURES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3": GemmaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "phi3": Phi3ForCausalLM,
    # Encoders (ModelConfig.is_causal false): embeddings and cross-encoder scores, no generation.
    "bert": BertForPooling,
    "nomic-bert": NomicBertForPooling,
    "xlm-roberta": XLMRobertaForPooling,
}

# Names found in files → canonical key.
_ALIASES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "gemma3_text": "gemma3",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Phi3ForCausalLM": "phi3",
    # A bare encoder and the same encoder with a classification head run as one class (num_labels says which).
    "BertModel": "bert",
    "BertForSequenceClassification": "bert",
    "NomicBertModel": "nomic-bert",
    "nomic_bert": "nomic-bert",
    "XLMRobertaModel": "xlm-roberta",
    "XLMRobertaForSequenceClassification": "xlm-roberta",
}


def canonical_architecture(name: str, path: str) -> str:
    """Map a file's architecture name to a key of ARCHITECTURES, or explain that tokenriver cannot run it."""
    key = _ALIASES.get(name, name)
    if key not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES)) + " (Hugging Face: " + ", ".join(sorted(_ALIASES)) + ")"
        raise ModelLoadError(f"{path}: architecture {name!r} is not supported; tokenriver runs {supported}", path=path)
    return key


def model_class(architecture: str) -> type[nn.Module]:
    """The class for a canonical architecture key (as stored in ModelConfig.architecture)."""
    return ARCHITECTURES[architecture]
