"""The new knobs refuse what they cannot do, naming the parameter: beam-search SamplingParams, speculative config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenriver.config import EngineConfig
from tokenriver.decoding.draft_model import check_same_vocabulary
from tokenriver.errors import InvalidParameterError
from tokenriver.params import SamplingParams


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 2, "n": 3}, "n"),
        ({"beam_width": 2, "temperature": 0.7}, "temperature"),
        ({"beam_width": 2, "top_p": 0.9}, "top_p"),
        ({"beam_width": 2, "repetition_penalty": 1.2}, "repetition_penalty"),
        ({"beam_width": 2, "best_of": 3}, "best_of"),
        ({"beam_width": 2, "trace": True}, "trace"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"length_penalty": float("nan")}, "length_penalty"),
    ],
)
def test_beam_search_params_are_checked(fields, param):
    with pytest.raises(InvalidParameterError) as error:
        SamplingParams(**fields)
    assert error.value.param == param


def test_beam_search_params_accept_transformers_values():
    params = SamplingParams(beam_width=4, n=4, temperature=0.0, early_stopping="True", length_penalty=-0.5)
    assert params.use_beam_search and params.early_stopping is True
    assert SamplingParams(beam_width=2, early_stopping="never").early_stopping == "never"
    assert not SamplingParams().use_beam_search


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"speculative_draft": "self:x"}, "speculative_draft"),
        ({"speculative_draft": "self:0"}, "speculative_draft"),
        ({"speculative_draft": "ngram", "use_kv_cache": False}, "speculative_draft"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"ngram_min": 5, "ngram_max": 3}, "ngram_min"),
    ],
)
def test_speculative_config_is_checked(fields, param):
    with pytest.raises(InvalidParameterError) as error:
        EngineConfig.from_flat(**fields)
    assert error.value.param == param


def _loaded(vocab_size: int, texts: dict[int, str]) -> SimpleNamespace:
    tokenizer = SimpleNamespace(token_text=lambda token_id: texts.get(token_id, f"<{token_id}>"))
    return SimpleNamespace(config=SimpleNamespace(vocab_size=vocab_size), tokenizer=tokenizer, path="draft.gguf")


def test_a_draft_with_another_tokenizer_is_refused():
    target = _loaded(100, {5: "cat"})
    check_same_vocabulary(_loaded(100, {5: "cat"}), target)
    with pytest.raises(InvalidParameterError, match="vocabulary of 90"):
        check_same_vocabulary(_loaded(90, {5: "cat"}), target)
    with pytest.raises(InvalidParameterError, match="token 5"):
        check_same_vocabulary(_loaded(100, {5: "dog"}), target)
