"""LlamaForCausalLM on the embedded SmolLM2 GGUF vs Hugging Face transformers on the same file.

The reference is transformers' own GGUF loader and Llama implementation; token
ids come from its tokenizer so these tests depend only on the model code and
the loader. Also: chunked prefill, decode steps and batching must give the
same logits as one pass over one request.
"""

from __future__ import annotations

import pytest
import torch

from tokenriver.kv.cache import KVCache
from tokenriver.loader.assemble import build_model
from tokenriver.models.attention import AttentionMetadata
from tokenriver.models.llama import LlamaForCausalLM

BLOCK_SIZE = 16

LONG_TEXT = (
    "The river starts as snowmelt high in the mountains, gathering speed as it falls through narrow gorges. "
    "By the time it reaches the plains it is wide and slow, carrying silt that farmers have relied on for "
    "thousands of years. Cities grew at its bends; bridges, mills and ports followed. In the nineteenth century "
    "engineers straightened long stretches to speed up shipping, which caused floods further downstream. "
)


@pytest.fixture(scope="module")
def ours(loaded_float32) -> LlamaForCausalLM:
    """The engine's own load path (load_model, session fixture in tests/conftest.py)."""
    return loaded_float32.model


@pytest.fixture(scope="module")
def prompts(hf_reference) -> dict[str, list[int]]:
    _, tokenizer = hf_reference
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about rivers."}], add_generation_prompt=True, tokenize=True
    )
    long_ids = tokenizer(LONG_TEXT * 20)["input_ids"][:1000]
    return {
        "short": tokenizer("The capital of France is")["input_ids"],
        "long": long_ids,
        "non_ascii": tokenizer("Größe, naïve café — 東京タワー, Привет мир! 🚀🌊 ¿Qué tal?")["input_ids"],
        "chat": list(chat["input_ids"]),
    }


@pytest.fixture(scope="module")
def reference_logits(hf_reference, prompts) -> dict[str, torch.Tensor]:
    model, _ = hf_reference
    with torch.no_grad():
        return {name: model(torch.tensor([ids])).logits[0].float() for name, ids in prompts.items()}


def run_steps(model: LlamaForCausalLM, requests: list[list[int]], steps: list[list[int]]) -> list[torch.Tensor]:
    """Feed each request's tokens in chunks; steps[s][r] tokens of request r go in step s (0 = skip).

    Returns, per request, the logits of all its tokens in order, [len(tokens), vocab].
    """
    config = model.config
    num_blocks = [-(-len(ids) // BLOCK_SIZE) for ids in requests]
    firsts = [sum(num_blocks[:i]) for i in range(len(requests))]
    tables = [list(range(first, first + n)) for first, n in zip(firsts, num_blocks)]
    dtype = next(model.parameters()).dtype
    cache = KVCache(config.num_layers, sum(num_blocks), BLOCK_SIZE, config.num_kv_heads, config.head_dim, dtype)
    done = [0] * len(requests)
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
        hidden = model(torch.tensor(ids), torch.tensor(positions), cache, metadata)
        logits = model.compute_logits(hidden)
        start = 0
        for r in active:
            outputs[r].append(logits[start : start + step[r]])
            start += step[r]
            done[r] += step[r]
    return [torch.cat(chunks) for chunks in outputs]


def run_one(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    return run_steps(model, [ids], [[len(ids)]])[0]


@pytest.mark.parametrize("name", ["short", "long", "non_ascii", "chat"])
def test_float32_logits_match_transformers(ours, prompts, reference_logits, name):
    ref = reference_logits[name]
    got = run_one(ours, prompts[name])
    assert got.dtype == torch.float32 and got.shape == ref.shape
    relative_error = ((got - ref).norm() / ref.norm()).item()
    assert relative_error < 1e-3, f"{name}: ||ours - ref|| / ||ref|| = {relative_error:.2e}"
    ref_logprobs, got_logprobs = ref.log_softmax(-1), got.log_softmax(-1)
    top5 = ref_logprobs.topk(5, dim=-1).indices  # [T, 5]
    diff = (got_logprobs.gather(1, top5) - ref_logprobs.gather(1, top5)).abs()
    worst = int(diff.max(dim=1).values.argmax())
    assert diff.max().item() < 1e-3, f"{name}: top-5 logprob differs by {diff.max().item():.2e} at position {worst}"


def test_chunked_prefill_and_decode_match_one_pass(ours, prompts):
    ids = prompts["chat"]
    whole = run_one(ours, ids)
    # Prefill 13 tokens, then a 9-token chunk, then one-token decode steps for the rest.
    steps = [[13], [9]] + [[1]] * (len(ids) - 22)
    stepped = run_steps(ours, [ids], steps)[0]
    assert torch.allclose(stepped, whole, rtol=0, atol=1e-4), (stepped - whole).abs().max()
    assert torch.equal(stepped.argmax(-1), whole.argmax(-1))


def test_batch_of_two_prompts_equals_each_alone(ours, prompts):
    first, second = prompts["short"], prompts["non_ascii"]
    alone = [run_one(ours, first), run_one(ours, second)]
    # Both prompts in one step, then a mixed step: request 0 decodes its last token while request 1
    # prefills the rest of its prompt.
    together = run_steps(ours, [first, second], [[len(first), len(second)]])
    mixed = run_steps(ours, [first, second], [[len(first) - 1, 5], [1, len(second) - 5]])
    for batched in (together, mixed):
        for got, want in zip(batched, alone):
            assert torch.allclose(got, want, rtol=0, atol=1e-4), (got - want).abs().max()


def test_bfloat16_greedy_agrees_with_float32_reference(ours, prompts, reference_logits):
    weights = {name: tensor.to(torch.bfloat16) for name, tensor in ours.state_dict().items()}
    model = build_model(ours.config, weights, "cpu", dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    agree = total = 0
    for name, ids in prompts.items():
        ids = ids[:128]
        logits = run_one(model, ids)
        assert logits.dtype == torch.float32
        agree += int((logits.argmax(-1) == reference_logits[name][: len(ids)].argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= 0.95, f"bfloat16 top-1 agrees with float32 on {agree}/{total} positions"
