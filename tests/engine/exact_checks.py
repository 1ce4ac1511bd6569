"""The equivalence checks of "exact by default", shared by the test modules that run them on several model files.

Each check computes the same requests two ways with the engine's default settings and asserts that every request
gets the same tokens and the same logprobs, bit for bit (and, where the check covers prompts, the same prompt
logprobs): alone and batched, whole prompts and chunked ones, prefix-cache hits and cold prompts, preempted and
uninterrupted requests, speculative and plain decoding, seeded sampling alone and in a batch.
"""

from __future__ import annotations

import random

from tokenriver.engine.llm import LLM
from tokenriver.loader.load import LoadedModel
from tokenriver.params import SamplingParams

# What a request produced: its tokens, each token's logprob, and its prompt tokens' logprobs (None where not asked).
Result = tuple[list[int], list[float], list[float] | None]


def make_prompts(loaded: LoadedModel, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths in tokens, from a fixed text cut at random places: real words, so the model's
    distributions are those of text, and a shared start, so prefix caching has something to find."""
    words = (
        "the river carries light across the valley while a small robot counts the stones and the keeper of the "
        "lighthouse writes down every ship that passes in a book of tides and weather and quiet evenings "
    ).split()
    rng = random.Random(seed)
    text = " ".join(rng.choice(words) for _ in range(4 * max(lengths) + 64))
    ids = loaded.tokenizer.encode(text)
    starts = [0 if i % 3 == 0 else rng.randrange(0, len(ids) - length) for i, length in enumerate(lengths)]
    return [ids[start : start + length] for start, length in zip(starts, lengths)]


def results(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[Result]:
    """Each request's tokens, token logprobs and prompt logprobs, in request order."""
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    found = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
        prompt_logprobs = None
        if output.prompt_logprobs is not None:
            prompt_logprobs = [
                step[token].logprob for step, token in zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:])
            ]
        found.append((completion.token_ids, logprobs, prompt_logprobs))
    return found


def greedy(max_tokens: list[int], prompt_logprobs: bool = False) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=count,
            temperature=0.0,
            ignore_eos=True,
            logprobs=0,
            prompt_logprobs=0 if prompt_logprobs else None,
        )
        for count in max_tokens
    ]


def alone(loaded: LoadedModel, prompts: list[list[int]], params: list[SamplingParams], **options) -> list[Result]:
    """Each request in an engine of its own, one at a time, prefix caching off: the reference."""
    llm = LLM.from_loaded(loaded, max_num_seqs=1, enable_prefix_caching=False, **options)
    return [results(llm, [prompt], [param])[0] for prompt, param in zip(prompts, params)]


def assert_same(got: list[Result], want: list[Result]) -> None:
    """Equal tokens and logprobs, request by request, with the first difference named."""
    assert len(got) == len(want)
    for index, (one, two) in enumerate(zip(got, want)):
        assert one[0] == two[0], f"request {index}: tokens {one[0]} != {two[0]}"
        assert one[1] == two[1], f"request {index}: logprobs {one[1]} != {two[1]}"
        assert one[2] == two[2], f"request {index}: prompt logprobs differ"


def check_batched_equals_alone(loaded: LoadedModel, prompts: list[list[int]], max_tokens: list[int]) -> None:
    params = greedy(max_tokens)
    batched = LLM.from_loaded(loaded, enable_prefix_caching=False)
    assert_same(results(batched, prompts, params), alone(loaded, prompts, params))


def check_chunked_prefill_equals_whole(loaded: LoadedModel, prompts: list[list[int]], budget: int) -> None:
    """Prompts cut into chunks of at most `budget` tokens a step (several requests' chunks and decode rows sharing
    a step) against each prompt whole; the prompt logprobs too."""
    params = greedy([6] * len(prompts), prompt_logprobs=True)
    chunked = LLM.from_loaded(loaded, max_num_batched_tokens=budget, enable_prefix_caching=False)
    whole = alone(loaded, prompts, params, max_num_batched_tokens=max(map(len, prompts)) + 8)
    assert_same(results(chunked, prompts, params), whole)


def check_prefix_hit_equals_cold(loaded: LoadedModel, prompts: list[list[int]]) -> None:
    """Each prompt run twice in one engine, the second time from its cached blocks (and the later prompts after
    those sharing their start): every run equals the prompt computed cold."""
    params = greedy([8] * len(prompts))
    cached = LLM.from_loaded(loaded)
    first = results(cached, prompts, params)
    outputs = cached.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    assert sum(output.num_cached_tokens for output in outputs) > 0
    second = results(cached, prompts, params)
    cold = alone(loaded, prompts, params)
    assert_same(first, cold)
    assert_same(second, cold)


def check_preempted_equals_uninterrupted(loaded: LoadedModel, prompts: list[list[int]], pool_tokens: int) -> None:
    """A KV pool too small for the batch: requests are preempted, their blocks freed, and recomputed later."""
    params = greedy([24] * len(prompts))
    pressured = LLM.from_loaded(loaded, max_num_kv_tokens=pool_tokens, enable_prefix_caching=False)
    got = results(pressured, prompts, params)
    assert pressured.engine.scheduler.stats().num_preempted_total > 0
    assert_same(got, alone(loaded, prompts, params))


def check_speculation_equals_plain(loaded: LoadedModel, prompts: list[list[int]], draft: str, count: int) -> None:
    """Greedy speculative decoding (draft tokens verified in one pass, the accepted ones kept) against plain
    decoding, one request at a time and batched."""
    params = greedy([24] * len(prompts))
    speculative = LLM.from_loaded(
        loaded, speculative_draft=draft, num_speculative_tokens=count, enable_prefix_caching=False
    )
    got = results(speculative, prompts, params)
    assert speculative.engine.scheduler.stats().num_accepted_draft_tokens_total > 0
    assert_same(got, alone(loaded, prompts, params))


def check_seeded_sampling_batched_equals_alone(loaded: LoadedModel, prompts: list[list[int]]) -> None:
    """Seeded sampling at temperature 0.8 with top-p 0.95, two choices a prompt: the same draws in a batch."""
    params = [
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=100 + i, n=2, logprobs=0)
        for i in range(len(prompts))
    ]
    batched = LLM.from_loaded(loaded)
    llm = LLM.from_loaded(loaded, max_num_seqs=1, enable_prefix_caching=False)

    def choices(engine: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
        outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [
            [(c.token_ids, [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)]) for c in output.outputs]
            for output in outputs
        ]

    want = [choices(llm, [prompt], [param])[0] for prompt, param in zip(prompts, params)]
    assert choices(batched, prompts, params) == want
