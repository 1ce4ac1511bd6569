"""End to end against transformers: greedy continuations token for token, cached == uncached."""

from __future__ import annotations

import pytest
import torch

from tokenriver.engine.llm import LLM
from tokenriver.params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Les chats sont des animaux qui",
    "東京は日本の首都で、",
    "Once upon a time, in a small village by the sea, there lived",
]


def make_llm(loaded, **options) -> LLM:
    return LLM.from_loaded(loaded, max_num_kv_tokens=16384, **options)


@pytest.fixture(scope="module")
def llm(loaded_float32):
    return make_llm(loaded_float32)


def test_greedy_continuations_match_transformers(llm, hf_reference):
    model, hf_tokenizer = hf_reference
    eos = set(llm.get_tokenizer().eos_token_ids)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        ids = hf_tokenizer(prompt, return_tensors="pt").input_ids
        assert output.prompt_token_ids == ids[0].tolist()
        with torch.inference_mode():
            reference = model.generate(ids, max_new_tokens=64, do_sample=False)[0, ids.shape[1] :].tolist()
        # Both stop at the first end-of-sequence token (ours knows every EOS id the model declares).
        end = next((i + 1 for i, token in enumerate(reference) if token in eos), len(reference))
        expected, got = reference[:end], output.outputs[0].token_ids
        first_difference = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        assert got == expected, f"{prompt!r}: first difference at generated token {first_difference}"


def test_cached_and_uncached_decoding_agree(loaded_float32, llm):
    uncached = make_llm(loaded_float32, use_kv_cache=False)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with_cache = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    without_cache = [o.outputs[0].token_ids for o in uncached.generate(PROMPTS[:3], params, use_tqdm=False)]
    assert with_cache == without_cache
    assert uncached.engine.runner.num_forward_passes >= 24


def test_chat_applies_template_and_stops_at_end_of_turn(llm):
    (output,) = llm.chat(
        [{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False
    )
    completion = output.outputs[0]
    assert (
        output.prompt_token_ids[-3:]
        == llm.get_tokenizer().encode("<|im_start|>assistant\n", add_special_tokens=False)[-3:]
    )
    assert completion.text.strip()
    assert completion.finish_reason.value == "stop"
    assert "<|im_end|>" not in completion.text
