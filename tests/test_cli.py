"""The command line end to end: `tokenriver generate` (with --trace) and `tokenriver chat` (scripted stdin) in a
subprocess on the embedded model, their text against LLM's greedy output for the same prompts; `embed` and
`rerank` against LLM.embed and LLM.rerank; `--help` for every
command; bad values refused with a one-line error and exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tokenriver.cli import build_parser, main
from tokenriver.engine.llm import LLM
from tokenriver.params import PoolingParams, SamplingParams

COMMANDS = ["generate", "chat", "embed", "rerank", "serve", "visualize"]
PROMPT = "The capital of France is"


def _tokenriver(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    # Exact arithmetic whatever the defaults: the references below run the exactly loaded model (loaded_packed).
    return subprocess.run(
        [sys.executable, "-m", "tokenriver.cli", *args, "--threads", "2", "--no-int8-activations"],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
    )


@pytest.fixture(scope="module")
def generated():
    return _tokenriver("generate", PROMPT, "--max-tokens", "6", "--trace", "--trace-top", "3")


def test_generate_streams_the_greedy_completion(generated, loaded_packed):
    assert generated.returncode == 0, generated.stderr
    (expected,) = LLM.from_loaded(loaded_packed).generate(
        PROMPT, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False
    )
    assert generated.stdout == expected.outputs[0].text
    assert "generated tokens: 6 | finish: length" in generated.stderr


def test_generate_trace_prints_a_table_per_step(generated):
    lines = generated.stderr.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == [f"step {i}" for i in range(6)]
    assert all("rank 1, " in line and ", greedy" in line for line in steps)  # greedy takes the top candidate
    candidates = [line for line in lines if line.startswith("  ") and " id " in line and "logit" in line]
    assert len(candidates) == 6 * 3
    assert sum(line.lstrip().startswith("→") for line in candidates) == 6


def test_chat_reads_turns_from_stdin_and_resets(loaded_packed):
    script = "What is the capital of Italy?\n/reset\nName one colour.\n\n/exit\n"
    result = _tokenriver("chat", "--max-tokens", "5", "--system", "Answer briefly.", stdin=script)
    assert result.returncode == 0, result.stderr
    replies = [part.split("you> ")[0] for part in result.stdout.split("assistant> ")[1:]]
    llm = LLM.from_loaded(loaded_packed)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    system = {"role": "system", "content": "Answer briefly."}
    expected = [
        llm.chat([system, {"role": "user", "content": question}], params, use_tqdm=False)[0]
        for question in ("What is the capital of Italy?", "Name one colour.")
    ]  # /reset keeps the system
    assert replies == [output.outputs[0].text for output in expected]
    assert result.stdout.count("you> ") == 5  # two questions, /reset, the empty line, /exit


def test_embed_and_rerank_print_what_the_python_api_returns(loaded_packed):
    texts = ["The cat sat.", "Paris is in France."]
    embedded = _tokenriver("embed", *texts, "--dimensions", "8", "--pooling", "mean")
    assert embedded.returncode == 0, embedded.stderr
    llm = LLM.from_loaded(loaded_packed)
    want = llm.embed(texts, PoolingParams(pooling="mean", dimensions=8), use_tqdm=False)
    lines = [json.loads(line) for line in embedded.stdout.splitlines()]
    assert lines == [{"index": i, "embedding": output.embedding} for i, output in enumerate(want)]
    ranked = _tokenriver("rerank", "Where is Paris?", *texts)
    assert ranked.returncode == 0, ranked.stderr
    results = llm.rerank("Where is Paris?", texts, use_tqdm=False)
    assert ranked.stdout.splitlines() == [f"{r.relevance_score:.4f}  [{r.index}]  {r.document}" for r in results]


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_for_every_command(command, capsys):
    argv = ["--help"] if command is None else [command, "--help"]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: tokenriver{'' if command is None else ' ' + command}")
    if command is not None:
        assert "--model PATH" in text and "--kv-cache-memory SIZE" in text


def test_every_command_is_tested():
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(subparsers.choices) == sorted(COMMANDS)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--kv-cache-memory", "lots"], "kv_cache_memory"),
        (["generate", "hi", "--kv-cache-memory", "1GiB", "--max-num-kv-tokens", "64"], "give one of them"),
        (["embed", "hi", "--dimensions", "0"], "dimensions"),
    ],
)
def test_bad_values_are_one_line_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_device_without_a_gpu_is_a_one_line_error(capsys):
    assert main(["generate", "hi", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "sees no CUDA GPU" in err and "--device cpu" in err
