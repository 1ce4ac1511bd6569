"""Helpers for the per-architecture reference tests: tiny random transformers models, saved as Hugging Face folders
(and GGUF files), run through tokenriver's loader and model step by step over a paged KV cache.

Random init gives near-zero logits, so the weights are widened (`widen`) until a wrong mask, norm or rope would
show in the logits. Token ids are random: these tests depend on the model code and loaders only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from tokenriver.kv.cache import KVCache
from tokenriver.loader.assemble import build_model
from tokenriver.loader.safetensors import read_hf_folder
from tokenriver.models.attention import AttentionMetadata

BLOCK_SIZE = 16


def widen(model: nn.Module, seed: int, norm_range: tuple[float, float] = (0.5, 1.5)) -> nn.Module:
    """Normal(0, 0.2) matrices, norm weights uniform in norm_range: logits far from zero, every part mattering."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(*norm_range)
            else:
                param.normal_(0, 0.2)
    return model.eval()


def write_byte_tokenizer(folder: Path, with_eos: bool = True) -> None:
    """A byte-level BPE with no merges: every byte one token, then <|endoftext|> (the last byte stands for it in a
    256-token model's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    eos = "<|endoftext|>" if with_eos else alphabet[-1]
    vocab = {piece: i for i, piece in enumerate(alphabet)} | ({eos: len(alphabet)} if with_eos else {})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    if with_eos:
        tokenizer.add_special_tokens([eos])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))


def random_ids(count: int, vocab_size: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab_size, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def load_folder(folder: str, quantization: str = "none") -> nn.Module:
    checkpoint = read_hf_folder(folder)
    return build_model(checkpoint.config, checkpoint.weights, "cpu", folder, quantization)


def run_steps(
    model: nn.Module,
    requests: list[list[int]],
    steps: list[list[int]],
    tables: list[list[int]] | None = None,
    cache: KVCache | None = None,
    start: list[int] | None = None,
) -> list[torch.Tensor]:
    """Feed each request's tokens in chunks; steps[s][r] tokens of request r go in step s (0 = skip).

    tables: each request's block ids (default: disjoint blocks); cache: a KV cache to reuse (a prefix-cache hit
    is a table naming blocks another request filled); start: tokens of each request already in the cache.
    Returns, per request, the logits of the tokens it computed, in order [n, vocab].
    """
    config = model.config
    if tables is None:
        num_blocks = [-(-len(ids) // BLOCK_SIZE) for ids in requests]
        firsts = [sum(num_blocks[:i]) for i in range(len(requests))]
        tables = [list(range(first, first + n)) for first, n in zip(firsts, num_blocks)]
    if cache is None:
        total = max(b for table in tables for b in table) + 1
        dtype = next(model.parameters()).dtype
        cache = KVCache(config.num_layers, total, BLOCK_SIZE, config.num_kv_heads, config.head_dim, dtype)
    done = list(start) if start is not None else [0] * len(requests)
    outputs: list[list[torch.Tensor]] = [[] for _ in requests]
    for step in steps:
        active = [r for r, n in enumerate(step) if n]
        ids, positions = [], []
        for r in active:
            ids += requests[r][done[r] : done[r] + step[r]]
            positions += list(range(done[r], done[r] + step[r]))
        metadata = AttentionMetadata.build(
            [step[r] for r in active], [done[r] + step[r] for r in active], [tables[r] for r in active], BLOCK_SIZE
        )
        logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(positions), cache, metadata))
        offset = 0
        for r in active:
            outputs[r].append(logits[offset : offset + step[r]])
            offset += step[r]
            done[r] += step[r]
    return [torch.cat(chunks) if chunks else torch.empty(0) for chunks in outputs]


def run_one(model: nn.Module, ids: list[int]) -> torch.Tensor:
    return run_steps(model, [ids], [[len(ids)]])[0]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def greedy_ours(model: nn.Module, ids: list[int], count: int) -> list[int]:
    """Greedy continuation: prefill, then one decode step per new token."""
    config = model.config
    num_blocks = -(-(len(ids) + count) // BLOCK_SIZE)
    cache = KVCache(
        config.num_layers, num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim, next(model.parameters()).dtype
    )
    table = [list(range(num_blocks))]
    tokens = list(ids)
    new_tokens = len(ids)
    for _ in range(count):
        metadata = AttentionMetadata.build([new_tokens], [len(tokens)], table, BLOCK_SIZE)
        positions = torch.arange(len(tokens) - new_tokens, len(tokens))
        hidden = model(torch.tensor(tokens[-new_tokens:]), positions, cache, metadata)
        tokens.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
        new_tokens = 1
    return tokens[len(ids) :]


def greedy_transformers(model: nn.Module, ids: list[int], count: int) -> list[int]:
    """Greedy continuation by transformers, each token from a full forward pass (no stop tokens, no cache)."""
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(ids) :]


def transformers_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()
