"""beam_trace over HTTP: the server's beam-search steps are LLM.generate's, bit for bit, and misuse is a 400 naming
the field. The shared server runs with the defaults (tests/server/conftest.py), as LLM() does in this process."""

from __future__ import annotations

import json

import httpx
import pytest

from tokenriver.engine.llm import LLM
from tokenriver.params import SamplingParams

PROMPT = "The three primary colors are"
CHAT_TURN = "<|im_start|>user\nReply with one word: yes or no. Is water wet?<|im_end|>\n<|im_start|>assistant\n"
BEAMS = dict(beam_width=3, n=3, max_tokens=8)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def llm(loaded_default) -> LLM:
    return LLM.from_loaded(loaded_default)


def _post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("prompt", [PROMPT, CHAT_TURN])
def test_the_servers_beam_steps_are_llm_generates(http, llm, prompt):
    prompt_ids = llm.get_tokenizer().encode(prompt)
    response = _post(http, "/v1/completions", {"prompt": prompt_ids, **BEAMS, "beam_trace": True, "logprobs": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    (output,) = llm.generate(
        [{"prompt_token_ids": prompt_ids}], SamplingParams(**BEAMS, beam_trace=True, logprobs=0), use_tqdm=False
    )
    assert body["beam_steps"] == [[step.to_dict() for step in output.beam_steps]]
    assert [(c["token_ids"], c["beam_score"], c["text"]) for c in body["choices"]] == [
        (c.token_ids, c.beam_score, c.text) for c in output.outputs
    ]
    assert [sum(c["logprobs"]["token_logprobs"]) for c in body["choices"]] == [
        c.cumulative_logprob for c in output.outputs
    ]


def test_chat_returns_the_steps_too_and_plain_beams_carry_none(http):
    messages = [{"role": "user", "content": "Name a primary color."}]
    chat = _post(http, "/v1/chat/completions", {"messages": messages, **BEAMS, "beam_trace": True}).json()
    assert chat["beam_steps"] and chat["beam_steps"][-1]["is_last"]
    plain = _post(http, "/v1/completions", {"prompt": PROMPT, **BEAMS}).json()
    assert "beam_steps" not in plain and "token_ids" not in plain["choices"][0]


@pytest.mark.parametrize(
    "extra",
    [
        {"beam_trace": True},
        {**BEAMS, "beam_trace": True, "stream": True},
        {**BEAMS, "beam_trace": "yes"},
    ],
    ids=["without-beam-width", "streamed", "not-a-boolean"],
)
def test_misused_beam_trace_is_a_400_naming_it(http, extra):
    response = _post(http, "/v1/completions", {"prompt": PROMPT, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "beam_trace", error
    assert error["type"] == "invalid_request_error"
