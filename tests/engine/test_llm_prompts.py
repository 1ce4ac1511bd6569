"""LLM.generate's prompt forms: vLLM's (a string, {"prompt": ...}, {"prompt_token_ids": ...}) and what it refuses."""

from __future__ import annotations

import pytest

from tokenriver.engine.llm import LLM
from tokenriver.errors import InvalidParameterError
from tokenriver.params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(loaded_packed) -> LLM:
    return LLM.from_loaded(loaded_packed, max_num_seqs=4)


def test_a_text_prompt_dict_runs_like_the_string_and_its_token_ids(llm):
    text = "The river flows"
    ids = llm.get_tokenizer().encode(text)
    from_string, from_dict, from_ids = llm.generate(
        [text, {"prompt": text}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False
    )
    assert from_dict.prompt == text and from_dict.prompt_token_ids == ids
    assert from_string.outputs[0].token_ids == from_dict.outputs[0].token_ids == from_ids.outputs[0].token_ids


@pytest.mark.parametrize(
    "prompt, match",
    [
        ({"text": "hi"}, r"prompts\[1\].*keys \['text'\]"),
        ({"prompt": 3}, r"prompts\[1\].*'prompt' \(a string\)"),
        (7, r"prompts\[1\].*not int"),
    ],
)
def test_a_prompt_of_another_form_is_refused_and_nothing_stays_queued(llm, prompt, match):
    with pytest.raises(InvalidParameterError, match=match):
        llm.generate(["fine", prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_runs_from_other_threads_give_the_same_tokens_and_each_ends_its_threads_workers(llm, monkeypatch):
    import threading

    from tokenriver.engine import llm as llm_module

    released = []
    release = llm_module.release_thread_pool
    monkeypatch.setattr(
        llm_module, "release_thread_pool", lambda: (released.append(threading.get_ident()), release())[1]
    )
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode("The river flows")}
    (here,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert released == [threading.get_ident()]
    outputs, threads = [], []
    for _ in range(2):
        thread = threading.Thread(target=lambda: outputs.append(llm.generate(prompt, GREEDY, use_tqdm=False)[0]))
        thread.start()
        thread.join()
        threads.append(thread.ident)
    assert [output.outputs[0].token_ids for output in outputs] == [here.outputs[0].token_ids] * 2
    assert released[1:] == threads
