"""Tensor parallelism: ranks on this machine compute what one process does.

Rank 0 is the engine in this test process; the others are spawned processes. With the defaults (packed weights,
int8 activations) tokens and logprobs equal one process's bit for bit, for 2 and 4 ranks: one process sums the
row-parallel projections in the ranks' runs of columns and the ranks add those runs in the same order
(models/row_chains.py). With float32 activations they agree to float rounding.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tokenriver.distributed.sharding import partition, shard_layout, take_columns, take_rows
from tokenriver.engine.llm import LLM
from tokenriver.errors import InvalidParameterError
from tokenriver.models.quant import Int4Linear, Int8Linear, quantize_int4, quantize_int8
from tokenriver.params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
from arch_reference import random_ids, widen, write_byte_tokenizer  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def _run(quantization: str, tensor_parallel_size: int, max_tokens: int, **options) -> list:
    llm = LLM(
        quantization=quantization,
        tensor_parallel_size=tensor_parallel_size,
        num_threads=1,
        max_num_kv_tokens=2048,
        **options,
    )
    try:
        return llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=3), use_tqdm=False)
    finally:
        llm.engine.close()


def _assert_same_tokens_and_logprobs(single: list, parallel: list) -> None:
    for one, two in zip(single, parallel):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        for position_one, position_two in zip(one.outputs[0].logprobs, two.outputs[0].logprobs):
            assert position_one.keys() == position_two.keys()
            for token_id, logprob in position_one.items():
                assert position_two[token_id].logprob == pytest.approx(logprob.logprob, abs=2e-4)


def test_two_ranks_match_one_process_in_reference_numerics():
    _assert_same_tokens_and_logprobs(_run("none", 1, 8), _run("none", 2, 8))


def test_two_ranks_equal_one_process_with_the_defaults():
    single, parallel = _run("auto", 1, 24), _run("auto", 2, 24)
    for one, two in zip(single, parallel, strict=True):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        assert _logprobs(two) == _logprobs(one)


def _logprobs(output) -> list[dict[int, float]]:
    return [{token: entry.logprob for token, entry in step.items()} for step in output.outputs[0].logprobs]


@pytest.fixture(scope="module")
def eight_kv_heads(tmp_path_factory) -> str:
    """A tiny random Llama with 8 kv heads (so 2 and 4 ranks split it), as a Hugging Face folder."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny_llama_tp")
    config = transformers.LlamaConfig(
        vocab_size=257,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=256,
    )
    torch.manual_seed(0)
    widen(transformers.LlamaForCausalLM(config), seed=1).save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path)
    return str(path)


@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_equal_one_process_on_a_quantized_model(eight_kv_heads, ranks):
    prompts = [{"prompt_token_ids": random_ids(n, 256, seed=n)} for n in (5, 23, 40)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=4)
    outputs = {}
    for size in (1, ranks):
        llm = LLM(eight_kv_heads, quantization="int4", tensor_parallel_size=size, num_threads=1)
        try:
            outputs[size] = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.engine.close()
    for one, many in zip(outputs[1], outputs[ranks], strict=True):
        assert many.outputs[0].token_ids == one.outputs[0].token_ids
        assert _logprobs(many) == _logprobs(one)


# An engine with two ranks that prints its spawned rank's pid as soon as it exists (argv[1] == "starting") or once
# the engine can serve, then waits to be killed.
_ENGINE_THEN_WAIT = """
import multiprocessing, sys, threading, time
from tokenriver.engine.llm import LLM

def report():
    while not multiprocessing.active_children():
        time.sleep(0.01)
    print(*(child.pid for child in multiprocessing.active_children()), flush=True)

if sys.argv[1] == "starting":
    threading.Thread(target=report, daemon=True).start()
llm = LLM(tensor_parallel_size=2, num_threads=1, max_num_kv_tokens=512)
report()
time.sleep(600)
"""


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")
@pytest.mark.parametrize("when", ["starting", "serving"])
def test_a_killed_engine_takes_its_ranks_with_it(when):
    """SIGKILL runs no exit handler in the engine. The rank it spawned must still end, whether it was loading and
    about to join the group (it would wait out the rendezvous timeout) or waiting for the next plan."""
    engine = subprocess.Popen(
        [sys.executable, "-c", _ENGINE_THEN_WAIT, when],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    try:
        ranks = [int(pid) for pid in engine.stdout.readline().split()]
        assert ranks, "the engine spawned no rank"
        assert all(_is_running(pid) for pid in ranks)
    finally:
        engine.send_signal(signal.SIGKILL)
        engine.wait()
    deadline = time.monotonic() + 30
    while any(_is_running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_is_running(pid) for pid in ranks)


def test_partition_is_contiguous_and_covers_everything():
    runs = [partition(3, 2, rank) for rank in range(2)]
    assert runs == [(0, 2), (2, 3)]
    assert [partition(10, 3, rank) for rank in range(3)] == [(0, 4), (4, 7), (7, 10)]


def test_layout_refuses_more_ranks_than_kv_heads():
    with pytest.raises(InvalidParameterError, match="kv heads"):
        shard_layout(num_heads=9, num_kv_heads=3, intermediate_size=1536, world_size=4, rank=0)


@pytest.mark.parametrize(
    "quantize",
    [
        lambda w: Int4Linear(quantize_int4(w, 32), backend="reference"),
        lambda w: Int8Linear(quantize_int8(w, 32), backend="reference"),
        lambda w: Int8Linear(quantize_int8(w), backend="reference"),
    ],
)
def test_packed_shards_add_up_to_the_whole_product(quantize):
    """Rows and column blocks of a packed weight, multiplied and summed as the ranks do, equal the whole layer."""
    torch.manual_seed(0)
    layer = quantize(torch.randn(96, 128))
    x = torch.randn(5, 128)
    whole = layer(x)  # [5, 96]
    rows = torch.cat([take_rows(layer, [(0, 40)])(x), take_rows(layer, [(40, 96)])(x)], dim=1)
    torch.testing.assert_close(rows, whole, rtol=0, atol=0)
    columns = take_columns(layer, 0, 64, keep_bias=True)(x[:, :64]) + take_columns(layer, 64, 128, False)(x[:, 64:])
    torch.testing.assert_close(columns, whole, rtol=1e-5, atol=1e-4)


def test_float_column_shards_keep_the_bias_once():
    torch.manual_seed(0)
    layer = nn.Linear(64, 8)
    x = torch.randn(3, 64)
    total = take_columns(layer, 0, 32, keep_bias=True)(x[:, :32]) + take_columns(layer, 32, 64, False)(x[:, 32:])
    torch.testing.assert_close(total, layer(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "options, param",
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        (
            {"tensor_parallel_size": 3, "nnodes": 2, "distributed_init_addr": "head-node.example:29500"},
            "tensor_parallel_size",
        ),
        ({"tensor_parallel_size": 2, "nnodes": 2}, "distributed_init_addr"),
        ({"nnodes": 2, "node_rank": 2, "distributed_init_addr": "h:1"}, "node_rank"),
        ({"tensor_parallel_size": 2, "speculative_draft": "ngram"}, "speculative_draft"),
    ],
)
def test_parallel_options_are_validated(options, param):
    from tokenriver.config import EngineConfig

    with pytest.raises(InvalidParameterError) as error:
        EngineConfig.from_flat(**options)
    assert error.value.param == param


def test_rendezvous_addresses():
    from tokenriver.distributed.group import init_method_for

    assert init_method_for("head-node.example:29500") == "tcp://head-node.example:29500"
    assert init_method_for(None) == "env://"
    with pytest.raises(InvalidParameterError, match="host:port"):
        init_method_for("nohost")
