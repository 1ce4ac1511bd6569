"""The greedy passes of a multi-step decode in one native call (models/cpu/greedy.py, through
runner/native_stack.py and runner/greedy_passes.py) against the same passes run one at a time from Python.

Both call the same kernels with the same arguments, so each pass's argmax, largest logit and log-sum-exp, and the
KV cache the passes leave, must be equal bit for bit: Llama, Qwen3 (q/k norms, windows the passes run past) and
Gemma 3 (scaled embeddings, (1 + weight) norms, local rotary tables), with an int4, int8 or float32 embedding,
exact or int8-rounded activations, one request, three, or twelve (past the output layer's GEMV rows: its GEMM).
Models whose parts around the stack have no native form (soft-capped logits, LongRoPE, a float output layer) are
declined. Through the engine, tokens and logprobs equal
the per-pass loop's, also when the native loop stops early and the runner finishes the passes.
"""

from __future__ import annotations

import pytest
import torch
from test_native_decoder import BLOCK_SIZE, family_tiny_model, quantized_tiny_model

from tokenriver.engine.llm import LLM
from tokenriver.kv.cache import KVCache
from tokenriver.models.attention import AttentionMetadata
from tokenriver.models.cpu.decoder import NativeDecoder
from tokenriver.models.cpu.greedy import GreedyLoop
from tokenriver.models.cpu.kernels import load_kernels
from tokenriver.models.quant import Int4Linear, Int8Linear, QuantizedEmbedding, quantize_int4, quantize_int8
from tokenriver.params import SamplingParams
from tokenriver.runner.native_stack import NativeStack

pytestmark = pytest.mark.skipif(
    load_kernels() is None, reason="native kernels need x86-64 AVX2/FMA/F16C and a C++ compiler"
)

PASSES = 9  # past a block boundary and past the sliding layers' window of 8


def with_quantized_output(model: torch.nn.Module, table: str, int8_activations: bool) -> torch.nn.Module:
    """The output layer quantized; with table "int4" or "int8" the embedding is that layer (tied, as GGUF files
    load), with "float" it stays a float32 table."""
    weight = model.lm_head.weight.detach().clone()
    if table == "int4":
        head = Int4Linear(quantize_int4(weight), int8_activations=int8_activations)
    else:
        head = Int8Linear(quantize_int8(weight, 32), int8_activations=int8_activations)
    model.lm_head = head
    if table != "float":
        model.model.embed_tokens = QuantizedEmbedding(head, torch.float32)
    return model


def tiny_model(family: str, table: str, int8_activations: bool) -> torch.nn.Module:
    model = (
        quantized_tiny_model(False, int8_activations)
        if family == "llama"
        else family_tiny_model(family, int8_activations)
    )
    return with_quantized_output(model, table, int8_activations)


def prefilled(model: torch.nn.Module, prompts: list[list[int]]) -> tuple[KVCache, list[list[int]]]:
    """A cache holding each prompt, and block tables with room for PASSES more tokens."""
    config = model.config
    blocks = [-(-(len(prompt) + PASSES) // BLOCK_SIZE) for prompt in prompts]
    tables = [list(range(sum(blocks[:r]), sum(blocks[: r + 1])))[::-1] for r in range(len(prompts))]
    cache = KVCache(config.num_layers, sum(blocks), BLOCK_SIZE, config.num_kv_heads, config.head_dim, torch.int8)
    ids = [t for prompt in prompts for t in prompt]
    positions = [p for prompt in prompts for p in range(len(prompt))]
    metadata = AttentionMetadata.build([len(p) for p in prompts], [len(p) for p in prompts], tables, BLOCK_SIZE)
    with torch.inference_mode():
        NativeStack(model)(torch.tensor(ids), torch.tensor(positions), cache, metadata)
    return cache, tables


def passes_one_by_one(
    model: torch.nn.Module, cache: KVCache, tables: list[list[int]], tokens: list[int], positions: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the runner does pass by pass: embed, the stack, final norm, output layer, the row reductions."""
    forward, kernels = NativeStack(model), load_kernels()
    reductions = []
    with torch.inference_mode():
        for p in range(PASSES):
            metadata = AttentionMetadata.build(
                [1] * len(tokens), [position + p + 1 for position in positions], tables, BLOCK_SIZE
            )
            hidden = forward(
                torch.tensor(tokens), torch.tensor([position + p for position in positions]), cache, metadata
            )
            argmax, max_logits, lse = kernels.argmax_logsumexp(model.compute_logits(hidden))
            reductions.append((argmax, max_logits, lse))
            tokens = argmax.tolist()
    return tuple(torch.stack(parts) for parts in zip(*reductions))


def padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(map(len, tables))
    return torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int64)


@pytest.mark.parametrize("num_requests", [1, 3, 12])
@pytest.mark.parametrize(
    "family,table,int8_activations",
    [
        ("llama", "int4", False),
        ("llama", "int8", True),
        ("llama", "float", True),
        ("qwen3", "int8", False),
        ("qwen3", "int4", True),
        ("gemma3", "int4", False),
        ("gemma3", "int8", True),
    ],
)
def test_native_passes_equal_the_passes_run_one_by_one(family, table, int8_activations, num_requests):
    model = tiny_model(family, table, int8_activations)
    lengths = [(14, 30, 5)[r % 3] + r // 3 for r in range(num_requests)]
    prompts = [[(5 * i + 11 * r) % 96 for i in range(length)] for r, length in enumerate(lengths)]
    first_tokens, positions = [(3 + 47 * r) % 96 for r in range(num_requests)], [len(prompt) for prompt in prompts]
    cache, tables = prefilled(model, prompts)
    reference_cache, _ = prefilled(model, prompts)
    want = passes_one_by_one(model, reference_cache, tables, first_tokens, positions)
    got = NativeStack(model).greedy_passes(PASSES, first_tokens, positions, padded(tables), cache)
    assert got is not None and got[0].shape == (PASSES, num_requests)
    for ours, reference in zip(got, want):
        assert torch.equal(ours, reference)
    for (keys, values), (want_keys, want_values) in zip(cache.layers, reference_cache.layers):
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


def test_a_pass_past_the_block_table_is_left_to_the_caller():
    model = tiny_model("llama", "int8", False)
    cache, tables = prefilled(model, [[1, 2, 3]])
    short = padded([tables[0][:1]])  # one block: positions 3..15 fit, the pass at 16 does not
    got = NativeStack(model).greedy_passes(20, [4], [3], short, cache)
    assert got is not None and got[0].shape == (BLOCK_SIZE - 3, 1)


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_models_without_native_parts_around_the_stack_are_declined(family):
    # Gemma 2 soft-caps its logits; Phi-3's LongRoPE tables depend on the context length.
    model = tiny_model(family, "int8", False)
    native = NativeDecoder.build(model.model.layers)
    assert native is not None and GreedyLoop.build(model, native) is None  # the stack itself runs natively
    cache, tables = prefilled(model, [[1, 2, 3]])
    assert NativeStack(model).greedy_passes(4, [4], [3], padded(tables), cache) is None


def test_a_float_output_layer_is_declined():
    model = quantized_tiny_model(False)
    native = NativeDecoder.build(model.model.layers)
    assert native is not None and GreedyLoop.build(model, native) is None


def engine_outputs(loaded, prompts: list[str], steps: int) -> list[tuple[list[int], float]]:
    llm = LLM.from_loaded(loaded, max_num_kv_tokens=2048, num_scheduler_steps=steps)
    params = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.stats().num_blocks_used == 0
    return [(list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob) for o in outputs]


PROMPTS = ["The river carries", "Paged attention keeps each request's keys"]


def test_the_engine_takes_the_native_loop_with_the_same_tokens_and_logprobs(loaded_packed, monkeypatch):
    calls = []
    run = GreedyLoop.run
    monkeypatch.setattr(GreedyLoop, "run", lambda self, *args: calls.append(args[0]) or run(self, *args))
    looped = engine_outputs(loaded_packed, PROMPTS, 8)
    assert calls == [7, 7, 3]  # 21 tokens: the prompt step's, then steps of 8 passes (the first in Python), 8, 4
    monkeypatch.setattr(NativeStack, "greedy_passes", lambda *args: None)
    assert looped == engine_outputs(loaded_packed, PROMPTS, 8) == engine_outputs(loaded_packed, PROMPTS, 1)


def test_passes_the_native_loop_leaves_run_in_python(loaded_packed, monkeypatch):
    run = GreedyLoop.run

    def stops_after_three(self, *args):  # as when a row's logits are not finite at the fourth pass
        return tuple(part[:3] for part in run(self, *args))

    monkeypatch.setattr(GreedyLoop, "run", stops_after_three)
    assert engine_outputs(loaded_packed, PROMPTS, 8) == engine_outputs(loaded_packed, PROMPTS, 1)
