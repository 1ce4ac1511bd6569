"""Beam search in the engine: transformers' generate(num_beams=k) results, shared KV blocks, batching, preemption."""

from __future__ import annotations

import pytest
import torch

from tokenriver.engine.llm import LLM
from tokenriver.outputs import FinishReason
from tokenriver.params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    # A chat turn the model often ends with <|im_end|> within the budget: hypotheses that stop at EOS.
    "<|im_start|>user\nReply with one word: yes or no. Is water wet?<|im_end|>\n<|im_start|>assistant\n",
]
MAX_TOKENS = 16
CONFIGS = [
    pytest.param(2, 1.0, False, id="k2-lp1-heuristic"),
    pytest.param(4, 0.5, True, id="k4-lp0.5-early"),
    pytest.param(4, 2.0, "never", id="k4-lp2-never"),
    pytest.param(2, 0.0, False, id="k2-lp0"),
]


def make_llm(loaded, **options) -> LLM:
    # One thread: on a shared 2-core machine a second OpenMP thread that loses its core stalls every op.
    return LLM.from_loaded(loaded, **{"max_num_kv_tokens": 8192, "num_threads": 1, **options})


@pytest.fixture(scope="module")
def llm(loaded_float32):
    return make_llm(loaded_float32)


def beam_params(k: int, length_penalty: float, early_stopping, **extra) -> SamplingParams:
    return SamplingParams(
        beam_width=k, n=k, length_penalty=length_penalty, early_stopping=early_stopping, max_tokens=MAX_TOKENS, **extra
    )


@pytest.mark.parametrize("k, length_penalty, early_stopping", CONFIGS)
def test_beam_search_equals_transformers(llm, hf_reference, k, length_penalty, early_stopping):
    model, hf_tokenizer = hf_reference
    eos = list(llm.get_tokenizer().eos_token_ids)
    # All prompts in one batch: beams of different requests share the steps.
    outputs = llm.generate(
        [{"prompt_token_ids": hf_tokenizer(p).input_ids} for p in PROMPTS],
        beam_params(k, length_penalty, early_stopping),
        use_tqdm=False,
    )
    for prompt, output in zip(PROMPTS, outputs):
        ids = hf_tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            reference = model.generate(
                ids,
                max_new_tokens=MAX_TOKENS,
                num_beams=k,
                do_sample=False,
                length_penalty=length_penalty,
                early_stopping=early_stopping,
                num_return_sequences=k,
                eos_token_id=eos,
                pad_token_id=eos[0],
                output_scores=True,
                return_dict_in_generate=True,
            )
        expected = [_strip_padding(s[ids.shape[1] :].tolist(), eos) for s in reference.sequences]
        got = [c.token_ids for c in output.outputs]
        assert got[0] == expected[0], f"{prompt!r}: best beam differs"
        assert got == expected, f"{prompt!r}: beams differ"
        assert [c.beam_score for c in output.outputs] == pytest.approx(reference.sequences_scores.tolist(), abs=1e-3)
        for completion in output.outputs:
            length = len(completion.token_ids)
            assert completion.beam_score == pytest.approx(
                completion.cumulative_logprob / length**length_penalty, rel=1e-6
            )
            ends_at_eos = completion.token_ids[-1] in eos
            assert completion.finish_reason == (FinishReason.STOP if ends_at_eos else FinishReason.LENGTH)
    assert any(c.token_ids[-1] in eos for o in outputs for c in o.outputs), "no hypothesis ended at EOS"
    assert llm.engine.scheduler.stats().num_blocks_used == 0


def _strip_padding(tokens: list[int], eos: list[int]) -> list[int]:
    """transformers pads shorter hypotheses after their EOS."""
    end = next((i + 1 for i, token in enumerate(tokens) if token in eos), len(tokens))
    return tokens[:end]


def test_beams_share_the_prompts_blocks_and_copy_only_the_last(loaded_float32):
    llm = make_llm(loaded_float32, enable_prefix_caching=False)
    engine = llm.engine
    prompt = llm.get_tokenizer().encode("A long story about a river and its tokens. " * 20)
    copies, peak = [], 0
    execute = engine.runner.execute

    def watch(scheduler_output, draft_probs=None):
        nonlocal peak
        copies.extend(scheduler_output.block_copies)
        peak = max(peak, engine.block_manager.num_used_blocks)
        return execute(scheduler_output, draft_probs)

    engine.runner.execute = watch
    (output,) = llm.generate(
        [{"prompt_token_ids": prompt}], beam_params(4, 1.0, "never", ignore_eos=True), use_tqdm=False
    )
    block_size = engine.config.cache.block_size
    prompt_blocks = -(-len(prompt) // block_size)
    # The prompt's blocks once, plus at most two blocks of tail per beam (the partial one and its growth).
    assert peak <= prompt_blocks + 4 * (-(-MAX_TOKENS // block_size) + 2)
    assert peak < 2 * prompt_blocks
    assert copies, "forked beams never copied their shared partial block"
    # Prefix caching off and on, and a roomy or a cramped pool, must not change a token.
    cached = make_llm(loaded_float32).generate(
        [{"prompt_token_ids": prompt}], beam_params(4, 1.0, "never", ignore_eos=True), use_tqdm=False
    )
    assert [c.token_ids for c in cached[0].outputs] == [c.token_ids for c in output.outputs]
    assert engine.scheduler.stats().num_blocks_used == 0


def test_beam_requests_in_a_busy_batch_and_under_preemption(loaded_float32, llm):
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.encode(p)} for p in PROMPTS[:2]]
    beams = beam_params(3, 1.0, False)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    alone = [llm.generate([p], beams, use_tqdm=False)[0] for p in prompts]
    plain = llm.generate(prompts, greedy, use_tqdm=False)
    cramped = make_llm(loaded_float32, max_num_kv_tokens=96, max_num_batched_tokens=32, max_num_seqs=8)
    mixed = cramped.generate(prompts + prompts, [beams, beams, greedy, greedy], use_tqdm=False)
    for expected, got in zip(alone + plain, mixed):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected.outputs]
    for expected, got in zip(alone, mixed):
        assert [c.beam_score for c in got.outputs] == pytest.approx([c.beam_score for c in expected.outputs], abs=1e-4)
    stats = cramped.engine.scheduler.stats()
    assert stats.num_preempted_total > 0
    assert stats.num_blocks_used == 0 and not cramped.engine.has_unfinished_requests()


def test_beam_logprobs_stop_strings_and_abort(llm):
    params = beam_params(2, 1.0, False, logprobs=2)
    (output,) = llm.generate(["Count: 1, 2, 3,"], params, use_tqdm=False)
    for completion in output.outputs:
        assert len(completion.logprobs) == len(completion.token_ids)
        summed = sum(position[token].logprob for token, position in zip(completion.token_ids, completion.logprobs))
        assert summed == pytest.approx(completion.cumulative_logprob, abs=1e-5)
        assert all(len(position) <= 3 for position in completion.logprobs)
    text = output.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    (stopped,) = llm.generate(["Count: 1, 2, 3,"], beam_params(2, 1.0, False, stop=[stop]), use_tqdm=False)
    for completion in stopped.outputs:
        assert stop not in completion.text
    assert stopped.outputs[0].finish_reason is FinishReason.STOP and stopped.outputs[0].stop_reason == stop
    engine = llm.engine
    engine.add_request("beams", llm.get_tokenizer().encode("Tell me a story."), beam_params(4, 1.0, False))
    for _ in range(4):
        engine.step()
    assert engine.scheduler.stats().num_blocks_used > 0
    engine.abort_request("beams")
    engine.step()
    assert engine.scheduler.stats().num_blocks_used == 0 and not engine.has_unfinished_requests()
