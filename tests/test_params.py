"""SamplingParams and EngineConfig reject every invalid value with an error naming the field."""

from __future__ import annotations

import pytest

from tokenriver.config import EngineConfig, parse_size
from tokenriver.errors import InvalidParameterError
from tokenriver.params import SamplingParams, StructuredOutput, is_plain_greedy

INVALID_SAMPLING = [
    ("n", 0),
    ("n", 1.5),
    ("n", True),
    ("best_of", 0),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "1"),
    ("top_k", -2),
    ("top_k", 1.0),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -1),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", 1e-300),
    ("repetition_penalty", 1e6),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3),
    ("frequency_penalty", -3),
    ("logit_bias", {5: 101}),
    ("logit_bias", {5: -100.5}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"5": 1.0}),
    ("seed", 1.5),
    ("seed", 2**64),
    ("seed", "7"),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("stop", [""]),
    ("stop", [3]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]),
    ("logprobs", 21),
    ("logprobs", -1),
    ("prompt_logprobs", 100),
    ("ignore_eos", "yes"),
    ("skip_special_tokens", 1),
    ("include_stop_str_in_output", None),
    ("trace", "true"),
    ("trace_top", 0),
    ("trace_top", 1000),
]


@pytest.mark.parametrize(("field", "value"), INVALID_SAMPLING)
def test_each_invalid_sampling_value_names_its_field(field, value):
    with pytest.raises(InvalidParameterError) as caught:
        SamplingParams(**{field: value})
    assert caught.value.param == field
    assert field in str(caught.value) and repr(value) in str(caught.value)


def test_cross_field_rules():
    with pytest.raises(InvalidParameterError, match="best_of") as caught:
        SamplingParams(n=3, best_of=2, temperature=1.0)
    assert caught.value.param == "best_of"
    with pytest.raises(InvalidParameterError, match="greedy") as caught:
        SamplingParams(n=2, temperature=0.0)
    assert caught.value.param == "temperature"
    with pytest.raises(InvalidParameterError, match="max_tokens") as caught:
        SamplingParams(min_tokens=10, max_tokens=5)
    assert caught.value.param == "min_tokens"


def test_vocabulary_checks_need_the_model():
    params = SamplingParams(logit_bias={100: 1.0}, stop_token_ids=[5])
    params.validate_for_vocab(1000)
    with pytest.raises(InvalidParameterError, match="outside the vocabulary") as caught:
        SamplingParams(logit_bias={5000: 1.0}).validate_for_vocab(1000)
    assert caught.value.param == "logit_bias"
    with pytest.raises(InvalidParameterError) as caught:
        SamplingParams(stop_token_ids=[1000]).validate_for_vocab(1000)
    assert caught.value.param == "stop_token_ids"


def test_valid_values_are_kept():
    params = SamplingParams(
        n=2,
        best_of=3,
        temperature=0.7,
        top_k=-1,
        top_p=0.5,
        min_p=0.1,
        stop="END",
        logit_bias={3: -100},
        seed=-5,
        max_tokens=None,
    )
    assert params.stop == ["END"] and params.num_generated == 3 and not params.is_greedy
    assert SamplingParams(temperature=1e-9).is_greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dtype", "float16"),
        ("block_size", 0),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 4),
        ("max_model_len", 0),
        ("num_threads", -1),
        ("kv_cache_memory", "lots"),
        ("kv_cache_memory", "-1GiB"),
        ("kv_cache_dtype", "int4"),
        ("kv_cache_dtype", "fp16"),
    ],
)
def test_each_invalid_engine_option_names_its_field(field, value):
    with pytest.raises(InvalidParameterError) as caught:
        EngineConfig.from_flat(**{field: value})
    assert caught.value.param == field


def test_kv_cache_dtype_auto_is_int8_with_fast_numerics_and_the_compute_dtype_otherwise():
    assert EngineConfig().resolved_kv_cache_dtype == "int8"
    assert EngineConfig.from_flat(dtype="bfloat16").resolved_kv_cache_dtype == "int8"
    assert EngineConfig.from_flat(reference_numerics=True).resolved_kv_cache_dtype == "float32"
    assert EngineConfig.from_flat(dtype="bfloat16", reference_numerics=True).resolved_kv_cache_dtype == "bfloat16"
    assert EngineConfig.from_flat(int8_activations=False).resolved_kv_cache_dtype == "float32"
    assert EngineConfig.from_flat(quantization="none").resolved_kv_cache_dtype == "float32"
    assert EngineConfig.from_flat(device="cuda").resolved_kv_cache_dtype == "bfloat16"
    assert EngineConfig.from_flat(device="cuda", dtype="float32").resolved_kv_cache_dtype == "float32"
    assert EngineConfig.from_flat(kv_cache_dtype="float16").resolved_kv_cache_dtype == "float16"


def test_the_compute_dtype_is_float32_on_the_cpu_and_bfloat16_on_a_gpu_unless_asked():
    assert EngineConfig().resolved_dtype == "float32"
    assert EngineConfig.from_flat(device="cuda").resolved_dtype == "bfloat16"
    assert EngineConfig.from_flat(device="cuda:1", dtype="float32").resolved_dtype == "float32"
    assert EngineConfig.from_flat(dtype="bfloat16").resolved_dtype == "bfloat16"


def test_a_gpu_turns_the_int8_rounding_off_and_refuses_it_when_asked():
    assert EngineConfig.from_flat(device="cuda").resolved_int8_activations is False
    with pytest.raises(InvalidParameterError) as caught:
        EngineConfig.from_flat(device="cuda", int8_activations=True)
    assert caught.value.param == "int8_activations"


def test_reference_numerics_turns_the_rounding_off_and_refuses_int8_activations():
    assert EngineConfig().resolved_int8_activations is None
    assert EngineConfig.from_flat(reference_numerics=True).resolved_int8_activations is False
    assert EngineConfig.from_flat(quantization="none").resolved_int8_activations is False
    with pytest.raises(InvalidParameterError) as caught:
        EngineConfig.from_flat(reference_numerics=True, int8_activations=True)
    assert caught.value.param == "int8_activations"


def test_sizes_parse_with_units():
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size(4096) == 4096
    assert EngineConfig.from_flat(kv_cache_memory="1MiB").cache.kv_cache_memory == 1024**2


@pytest.mark.parametrize(
    "params, num_output_tokens, eos_token_ids, expected",
    [
        (SamplingParams(temperature=0.0), 0, [2], True),
        (SamplingParams(temperature=0.5), 0, [2], False),
        (SamplingParams(temperature=0.0, logprobs=1), 0, [2], False),
        (SamplingParams(temperature=0.0, min_tokens=3), 1, [2], False),  # EOS held back: the logits change
        (SamplingParams(temperature=0.0, min_tokens=3), 3, [2], True),
        (SamplingParams(temperature=0.0, min_tokens=3), 1, [], True),  # nothing to hold back
        (SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9]), 1, [], False),
    ],
)
def test_one_definition_of_plain_greedy(params, num_output_tokens, eos_token_ids, expected):
    assert is_plain_greedy(params, num_output_tokens, eos_token_ids) is expected


def test_structured_output_shapes_are_checked():
    assert StructuredOutput.json({"type": "object"}).kind == "json_schema"
    for make, value in (
        (StructuredOutput.json, "{not json"),
        (StructuredOutput.json, "[1]"),
        (StructuredOutput.choice, []),
        (StructuredOutput.choice, ["a", ""]),
        (StructuredOutput.regex, ""),
        (StructuredOutput.grammar, ""),
    ):
        with pytest.raises(InvalidParameterError) as error:
            make(value)
        assert error.value.param == "structured_output"
    with pytest.raises(InvalidParameterError):
        StructuredOutput("xml", "<a/>")
    with pytest.raises(InvalidParameterError):
        SamplingParams(structured_output={"type": "object"})
    # A grammar narrows the argmax but needs no logits while it allows the raw one (Sampler.sample_reduced).
    assert is_plain_greedy(SamplingParams(temperature=0, structured_output=StructuredOutput.json_object()), 0, [])
