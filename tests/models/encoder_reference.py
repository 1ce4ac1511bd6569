"""Helpers for the encoder reference tests (BERT, nomic-bert, XLM-RoBERTa): a tiny WordPiece tokenizer folder, tiny
random transformers encoders saved as Hugging Face folders, GGUF files written from them the way llama.cpp's
converter writes encoders, and tokenriver's encoder run over several whole prompts in one step.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from tokenriver.models.attention_metadata import AttentionMetadata

# A WordPiece vocabulary of BERT's shape: its specials first, whole words, continuations ("##s"), every letter as a
# word start and as a continuation (so any lowercase word splits into known pieces), then fillers up to 200 ids.
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CLS_ID, SEP_ID = 2, 3
_WORDS = ["the", "quick", "brown", "fox", "jump", "over", "lazy", "dog", "what", "is", "cat", "##ing"]
_PIECES = [*_WORDS, "!", "?", ".", *string.ascii_lowercase, *(f"##{c}" for c in string.ascii_lowercase)]
VOCAB = [*SPECIALS, *_PIECES]
VOCAB += [f"tok{i}" for i in range(200 - len(VOCAB))]
assert len(set(VOCAB)) == len(VOCAB), "a piece twice would have two ids"

ENCODER_SIZES = dict(
    vocab_size=len(VOCAB),
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=64,
)


def write_wordpiece_tokenizer(folder: Path) -> None:
    """tokenizer.json and tokenizer_config.json as a BERT (uncased) checkpoint ships them: WordPiece over VOCAB, and a
    post-processor that makes "[CLS] A [SEP]" and "[CLS] A [SEP] B [SEP]" (B and its [SEP] of type 1)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordPiece({piece: i for i, piece in enumerate(VOCAB)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", CLS_ID), ("[SEP]", SEP_ID)],
    )
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(folder / "tokenizer.json"))
    names = ("pad_token", "unk_token", "cls_token", "sep_token", "mask_token")
    config = dict(zip(names, SPECIALS)) | {"do_lower_case": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def widen(model: nn.Module, seed: int) -> nn.Module:
    """Normal(0, 0.2) matrices and biases, LayerNorm weights uniform in (0.5, 1.5): outputs far from a random init's
    near-constant ones, so that a wrong position, token type, norm or head shows."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("LayerNorm" in name or "norm" in name or "emb_ln" in name) and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0, 0.2)
    return model.eval()


def save_folder(model: nn.Module, folder: Path, with_tokenizer: bool = True) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    if with_tokenizer:
        write_wordpiece_tokenizer(folder)
    return folder


def encoder_metadata(lengths: list[int]) -> AttentionMetadata:
    """A step of whole prompts (an encoder's: nothing cached before them)."""
    block_size = 16
    num_blocks = [-(-length // block_size) for length in lengths]
    firsts = [sum(num_blocks[:i]) for i in range(len(lengths))]
    tables = [list(range(first, first + n)) for first, n in zip(firsts, num_blocks)]
    return AttentionMetadata.build(lengths, lengths, tables, block_size)


def run_encoder(model: nn.Module, requests: list[list[int]]) -> list[torch.Tensor]:
    """Every request's whole prompt in one step, positions from 0 in each: per request its rows [n, hidden]."""
    lengths = [len(ids) for ids in requests]
    ids = torch.tensor([token for request in requests for token in request])
    positions = torch.cat([torch.arange(length) for length in lengths])
    hidden = model(ids, positions, None, encoder_metadata(lengths))
    return list(hidden.split(lengths))


def pair_token_types(ids: list[int]) -> list[int]:
    """What BERT's tokenizer gives a pair: 0 up to and including the first [SEP], 1 after it."""
    first_sep = ids.index(SEP_ID) if SEP_ID in ids else len(ids)
    return [0 if i <= first_sep else 1 for i in range(len(ids))]


def random_pair(length: int, seed: int) -> list[int]:
    """[CLS] random pieces [SEP] random pieces [SEP], the shape of a cross-encoder's input."""
    generator = torch.Generator().manual_seed(seed)
    body = torch.randint(len(SPECIALS), len(VOCAB), (length - 3,), generator=generator).tolist()
    middle = len(body) // 3
    return [CLS_ID, *body[:middle], SEP_ID, *body[middle:], SEP_ID]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


def row_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest relative error of a row (a token's hidden state)."""
    return ((got.double() - want.double()).norm(dim=-1) / want.double().norm(dim=-1)).max().item()


def phantom_vocabulary() -> tuple[list[str], list[int]]:
    """VOCAB as llama.cpp's converter writes a BERT vocabulary: control tokens as they are, continuations without
    their "##", every other piece with a "▁" in front; with its token types (3 control, 1 normal)."""
    tokens = [
        piece if piece in SPECIALS else piece[2:] if piece.startswith("##") else "\u2581" + piece for piece in VOCAB
    ]
    return tokens, [3 if piece in SPECIALS else 1 for piece in VOCAB]


def write_encoder_gguf(
    folder: Path,
    path: Path,
    arch: str,
    *,
    pooling_type: int | None,
    position_offset: int = 0,
    keep_pooler: bool = False,
    quantize: gguf.GGMLQuantizationType | None = None,
) -> None:
    """The folder's encoder as llama.cpp's convert_hf_to_gguf.py writes it: tensor names from gguf's own name map,
    the base model's prefix and the pooler dropped (kept as the `cls` head's dense layer with keep_pooler, a BERT
    reranker whose pooler a converter kept), XLM-RoBERTa's position rows before position_offset cut off, matrices in
    `quantize`'s type (else float32), and the WordPiece vocabulary respelled (phantom_vocabulary)."""
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    num_layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.NOMIC_BERT if arch == "nomic-bert" else gguf.MODEL_ARCH.BERT, 2)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny encoder")
    writer.add_block_count(num_layers)
    writer.add_context_length(config["max_position_embeddings"] - position_offset)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    if pooling_type is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling_type))
    if arch == "nomic-bert":
        writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    tokens, token_types = phantom_vocabulary()
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_type_count(config["type_vocab_size"])
    writer.add_bos_token_id(CLS_ID)
    writer.add_sep_token_id(SEP_ID)
    writer.add_unk_token_id(1)
    writer.add_pad_token_id(0)
    for name, tensor in weights.items():
        name = name.removeprefix("bert.").removeprefix("roberta.")
        if name.startswith("pooler."):
            if not keep_pooler:
                continue
            name = name.replace("pooler.dense", "classifier.dense")
        if name == "classifier.weight" or name == "classifier.bias":
            name = name.replace("classifier", "classifier.out_proj")
        values = tensor.float().numpy()
        if name == "embeddings.position_embeddings.weight":
            values = values[position_offset:]
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if quantize is not None and values.ndim == 2 and "position" not in name and "token_type" not in name:
            writer.add_tensor(gguf_name, gguf.quants.quantize(values, quantize), raw_dtype=quantize)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
