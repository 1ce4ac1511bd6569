"""Structured output end to end in the engine: the constrained tokens do not depend on the batch, on multi-step
scheduling of the other requests, on prefix caching or on preemption; beams and n > 1 candidates all match.

Reference: the same constrained request run alone, once, in an engine without those features.
"""

from __future__ import annotations

import json
import re

import jsonschema

from tokenriver.engine.llm import LLM
from tokenriver.params import SamplingParams, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CONSTRAINED = SamplingParams(max_tokens=40, temperature=0.0, structured_output=StructuredOutput.json(SCHEMA))
PLAIN = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = [{"role": "user", "content": "Describe a person as JSON."}]


def _texts(llm: LLM, conversations: list, params: list[SamplingParams]) -> list[str]:
    return [o.outputs[0].text for o in llm.chat(conversations, params, use_tqdm=False)]


def test_constrained_output_is_the_same_alone_batched_multi_step_and_cached(loaded_float32):
    alone = LLM.from_loaded(loaded_float32, max_num_kv_tokens=2048, enable_prefix_caching=False, num_scheduler_steps=1)
    (reference,) = _texts(alone, [PROMPT], [CONSTRAINED])
    jsonschema.validate(json.loads(reference), SCHEMA)
    others = [[{"role": "user", "content": "Count to ten."}], [{"role": "user", "content": "Name a color."}]]
    multi_step = LLM.from_loaded(loaded_float32, max_num_kv_tokens=2048, num_scheduler_steps=4)
    batched = _texts(multi_step, [PROMPT, *others], [CONSTRAINED, PLAIN, PLAIN])
    assert batched[0] == reference
    # The constrained request decoded several passes a step, its mask filled before each pass's sampling.
    passes_after_step = [entry.num_forward_passes for entry in multi_step.engine.pass_log]
    assert any(b - a > 1 for a, b in zip(passes_after_step, passes_after_step[1:]))
    assert _texts(multi_step, [PROMPT], [CONSTRAINED]) == [reference]  # the prompt's blocks come from the cache
    assert multi_step.engine.scheduler.stats().prefix_cache_hit_rate > 0


def test_n_candidates_and_beams_all_match_the_constraint(loaded_float32):
    llm = LLM.from_loaded(loaded_float32, max_num_kv_tokens=2048)
    pattern = r"[0-9]{3}-[0-9]{4}"
    sampled = SamplingParams(
        n=3, temperature=1.0, seed=1, max_tokens=12, structured_output=StructuredOutput.regex(pattern)
    )
    beams = SamplingParams(
        n=2, beam_width=3, temperature=0.0, max_tokens=12, structured_output=StructuredOutput.regex(pattern)
    )
    for params in (sampled, beams):
        (output,) = llm.generate(["My phone number is"], params, use_tqdm=False)
        assert len(output.outputs) == params.n
        for candidate in output.outputs:
            assert re.fullmatch(pattern, candidate.text), candidate.text
            assert candidate.finish_reason.value == "stop"


def test_constrained_output_survives_preemption(loaded_float32):
    alone = LLM.from_loaded(loaded_float32, max_num_kv_tokens=2048)
    (reference,) = _texts(alone, [PROMPT], [CONSTRAINED])
    cramped = LLM.from_loaded(
        loaded_float32, max_num_kv_tokens=128, max_num_batched_tokens=32, max_num_seqs=8, enable_prefix_caching=False
    )  # three copies of one prompt would share blocks
    texts = _texts(cramped, [PROMPT] * 3, [CONSTRAINED] * 3)
    assert texts == [reference] * 3
    assert cramped.engine.scheduler.stats().num_preempted_total > 0
