"""The engine over a model with sliding-window layers (a tiny random Gemma 3): prefix caching and batching.

A prompt that shares three KV blocks (48 tokens) with an earlier one, under a window of 8 tokens, must reuse those
blocks and still generate what an engine without prefix caching generates; prompts generated together must give
what each gives alone. The model's vocabulary is 256 tokens, so prompts go in as token ids; the tokenizer (only
used to detokenize) is the embedded model's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tokenriver.engine.llm import LLM
from tokenriver.loader.load import LoadedModel
from tokenriver.params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
from arch_reference import load_folder, random_ids  # noqa: E402
from test_gemma_reference import tiny_gemma  # noqa: E402


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, loaded_float32) -> LoadedModel:
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("gemma3_engine")
    tiny_gemma("gemma3").save_pretrained(folder, safe_serialization=True)
    model = load_folder(str(folder))
    parameters = {p.data_ptr(): p for p in model.parameters()}.values()
    return LoadedModel(
        model=model,
        config=model.config,
        tokenizer=loaded_float32.tokenizer,
        path=str(folder),
        num_parameters=sum(p.numel() for p in parameters),
        num_bytes=sum(p.numel() * p.element_size() for p in parameters),
    )


PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": ids} for ids in prompts], PARAMS, use_tqdm=False)


def test_prefix_cache_hit_past_the_window(loaded):
    shared = random_ids(48, 256, seed=11)
    first, second = shared + random_ids(5, 256, seed=12), shared + random_ids(9, 256, seed=13)
    cached = LLM.from_loaded(loaded, max_num_kv_tokens=1024)
    generate(cached, [first])
    (hit,) = generate(cached, [second])
    assert hit.num_cached_tokens >= 48
    uncached = LLM.from_loaded(loaded, max_num_kv_tokens=1024, enable_prefix_caching=False)
    (want,) = generate(uncached, [second])
    assert hit.outputs[0].token_ids == want.outputs[0].token_ids


def test_batched_prompts_equal_each_alone(loaded):
    prompts = [random_ids(n, 256, seed=n) for n in (3, 17, 40, 70)]
    llm = LLM.from_loaded(loaded, max_num_kv_tokens=2048, enable_prefix_caching=False)
    together = [out.outputs[0].token_ids for out in generate(llm, prompts)]
    alone = [generate(llm, [ids])[0].outputs[0].token_ids for ids in prompts]
    assert together == alone
    assert torch.tensor(together).numel() == 4 * PARAMS.max_tokens
