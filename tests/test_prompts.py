"""prompts.check_prompt: the one check every entry point runs on a prompt's token ids."""

from __future__ import annotations

import pytest

from tokenriver.errors import ContextLengthError, InvalidParameterError
from tokenriver.prompts import check_pooling_length, check_prompt


def test_a_good_prompt_comes_back_as_a_list():
    assert check_prompt((1, 2, 3), vocab_size=10, max_model_len=8) == [1, 2, 3]
    assert check_prompt([1, 2], vocab_size=10, max_model_len=8, max_tokens=6) == [1, 2]


@pytest.mark.parametrize(
    "token_ids, match",
    [
        ("abc", "must be a list of token ids"),
        (5, "must be a list of token ids"),
        ([], "is empty"),
        ([1, 10], "token id 10, outside the vocabulary"),
        ([1, -1], "token id -1"),
        ([1, True], "token id True"),
        ([1, 2.0], "token id 2.0"),
    ],
)
def test_bad_token_ids_are_refused_naming_the_field(token_ids, match):
    with pytest.raises(InvalidParameterError, match=match) as caught:
        check_prompt(token_ids, vocab_size=10, max_model_len=8, where="prompt[2]", param="prompt")
    assert caught.value.param == "prompt" and not isinstance(caught.value, ContextLengthError)


def test_the_context_must_leave_room_to_generate():
    with pytest.raises(ContextLengthError, match="holds 8 tokens, but prompt has 8") as caught:
        check_prompt(list(range(8)), vocab_size=10, max_model_len=8)
    assert (caught.value.num_tokens, caught.value.max_tokens, caught.value.param) == (8, 8, "prompt")
    with pytest.raises(ContextLengthError, match="asked for 9") as caught:
        check_prompt([1, 2, 3], vocab_size=10, max_model_len=8, max_tokens=6, max_tokens_param="max_completion_tokens")
    assert caught.value.param == "max_completion_tokens"


@pytest.mark.parametrize(
    "max_num_batched_tokens, num_pool_tokens, limit, remedy",
    [(16, 64, 16, "--max-num-batched-tokens"), (64, 16, 16, "--kv-cache-memory"), (16, 16, 16, "max_num_batched")],
)
def test_an_input_to_pool_must_fit_one_pass(max_num_batched_tokens, num_pool_tokens, limit, remedy):
    check_pooling_length(limit, max_num_batched_tokens, num_pool_tokens)
    with pytest.raises(ContextLengthError, match=remedy) as caught:
        check_pooling_length(limit + 1, max_num_batched_tokens, num_pool_tokens, where="input[1]", param="input")
    assert caught.value.message.startswith(f"input[1] has {limit + 1} tokens, but one forward pass takes at most")
    assert (caught.value.num_tokens, caught.value.max_tokens, caught.value.param) == (limit + 1, limit, "input")
