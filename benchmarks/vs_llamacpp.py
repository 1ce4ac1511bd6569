"""Head to head on the embedded model: tokenriver (int4, int8, bf16, float32) vs llama.cpp vs transformers.

Every engine configuration runs in its own worker process (so its peak RSS is its own), all loaded at once, with the
same thread count. The parent sends each measurement to every worker in turn, A, B, C, A, B, C... per repeat, so a
change in machine speed (memory bandwidth here drifts between ~30 and ~50 GB/s) hits all engines alike; the median
over repeats is reported. Only one worker computes at a time; the others wait on their stdin.

Measured, all greedy, on the same prompt token ids for every engine:
- single-stream decode tokens/s after a short chat prompt and after a 512-token prompt (128 generated tokens);
- prefill tokens/s of that 512-token prompt (512 / time to the first generated token);
- offline throughput, 32 and 64 chat prompts x 128 generated tokens (tokenriver: continuous batching;
  transformers: left-padded `generate`, best of --hf-batch-sizes; llama.cpp: not measured, llama-cpp-python runs
  one sequence at a time);
- peak RSS of each worker after all of the above (load included), and its RSS then;
- cold start: a fresh process from its start to its first generated token (imports, load, prompt), and
  `tokenriver generate` (int4) from process start to its first byte of output;
- perplexity on tests/data/perplexity_text.md (the text of tests/models/test_quant_perplexity.py), top-1 agreement
  with tokenriver float32 over that text, and how many of the greedy tokens after the chat prompt equal float32's.

Engines: tokenriver's `LLM` on the GGUF (int4 = the file's own Q4_1 weights kept packed, `quantization="auto"`;
int4 with int8 activations and f16 KV = the same with `int8_activations=True, kv_cache_dtype="float16"`, llama.cpp's
own arithmetic for Q4_1 weights and its default KV cache type, in every product; the same with an int8 KV cache =
`kv_cache_dtype="int8"` (about llama.cpp's q8_0 cache type);
int8 = `quantization="int8"` (one scale per output channel); the same with int8 activations and an int8 KV cache
(its products of more than 10 rows scale each 32-column block's integer sums by the activation scale alone);
bf16 = `quantization="none", dtype="bfloat16"`; float32 = `quantization="none"`, the dequantized reference),
every one with `num_scheduler_steps=8` (multi-step scheduling, as vLLM's --num-scheduler-steps: while every request
is a plain greedy decode, a step runs up to 8 forward passes and schedules and processes outputs once; the tokens
and text are those of single steps), prefix caching on (the engine's default, as in vLLM: the chat prompts of the
throughput runs share the template's system prompt) and its cache emptied before every measurement, so no run reuses
an earlier one's prompts; llama.cpp through llama-cpp-python on the same file (Q4_1);
transformers' `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` in float32 and bfloat16.

Needs the `bench` extra (`pip install -e '.[bench]'`; llama-cpp-python compiles llama.cpp from source, which needs a
C++ compiler and cmake). On CPUs with AMX tiles, llama-cpp-python 0.3.36 built for the native CPU crashed in its AMX
matrix product (a general protection fault loading its tile configuration; llama.cpp issue 20824 reports the same
function crashing); build it without AMX, keeping every other instruction set of the CPU (the comparison is then
against llama.cpp's AVX-512 and VNNI kernels, not its AMX ones):

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
    -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON"
    pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36

A full run takes about 20-25 minutes on 2 quiet cores (3 single-stream repeats, 1 throughput
repeat, 3 cold starts per engine; each extra --throughput-repeats adds ~10 minutes). --quick (16 tokens, 1 repeat,
4 and 8 prompts, 1 cold start: a few minutes) is a smoke test and writes to a temporary folder.

    python benchmarks/vs_llamacpp.py [--threads 2] [--repeats 3] [--throughput-repeats 1] [--quick]

Writes benchmarks/results/vs_llamacpp.md and vs_llamacpp.png.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import json
import math
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
PERPLEXITY_TEXT = BENCHMARKS.parent / "tests" / "data" / "perplexity_text.md"
CHAT_MESSAGE = "Write a short story about a river that carries words to the sea."
LONG_PROMPT_TOKENS = 512
# Tokens/s at batch 32 of vLLM's CPU build (bf16), measured in issue 8 on a 2-core AMD EPYC (Zen 4): the throughput
# target's base.
VLLM_CPU_BATCH32 = 520.0
# Pause before each measurement: a worker that just finished leaves its OpenMP threads spinning for a moment.
SETTLE_SECONDS = 0.3
REFERENCE = "tokenriver float32"
LLAMA = "llama.cpp Q4_1"
INT4 = "tokenriver int4 (Q4_1)"
INT4_X8 = "tokenriver int4, int8 activations, f16 KV"
INT4_X8_KV8 = "tokenriver int4, int8 activations, int8 KV"
INT8_X8_KV8 = "tokenriver int8, int8 activations, int8 KV"
# tokenriver's forward passes per scheduling step while every request is a plain greedy decode (multi-step).
NUM_SCHEDULER_STEPS = 8
CLI = "tokenriver generate (CLI, int4)"


@dataclass(frozen=True)
class EngineSpec:
    """One engine configuration, run in one worker process."""

    label: str
    # "tokenriver", "llama.cpp" or "transformers".
    kind: str
    dtype: str = "float32"
    # tokenriver's quantization mode ("auto" keeps the file's Q4_1 weights packed).
    quantization: str = "auto"
    # tokenriver: products of quantized weights with int8-rounded activations (llama.cpp's arithmetic).
    int8_activations: bool = False
    # tokenriver's KV pool dtype ("auto" = dtype; llama.cpp's default is float16).
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class Setup:
    """Everything a worker process needs to build its engine (sent as JSON on its command line)."""

    spec: EngineSpec
    model_path: str
    num_threads: int
    # tokenriver's KV pool in tokens: what the largest workload needs.
    num_kv_tokens: int


@dataclass(frozen=True)
class Settings:
    """What one run measures: the full run or --quick."""

    repeats: int
    throughput_repeats: int
    max_tokens: int
    throughput_prompts: tuple[int, ...]
    hf_batch_sizes: tuple[int, ...]
    perplexity_tokens: int | None
    cold_starts: int


# ---------------------------------------------------------------------------------------------------------------
# Engines, as seen from inside a worker. Each imports its library only here, so a llama.cpp worker's RSS has no torch.


def _greedy_run(times: list[float], started: float, tokens: list[int]) -> dict[str, object]:
    """Per-token timestamps (perf_counter) → seconds to the first token and decode tokens/s after it."""
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None
    return {"first_token_s": times[0] - started, "decode_tokens_per_s": decode, "token_ids": tokens}


def _scored(log_probs_of_text: list[float], argmax: list[int]) -> dict[str, object]:
    return {"perplexity": math.exp(-sum(log_probs_of_text) / len(log_probs_of_text)), "argmax": argmax}


class TokenriverEngine:
    def __init__(self, setup: Setup) -> None:
        from tokenriver import LLM

        spec = setup.spec
        self.llm = LLM(
            model=setup.model_path,
            dtype=spec.dtype,
            quantization=spec.quantization,
            int8_activations=spec.int8_activations,
            kv_cache_dtype=spec.kv_cache_dtype,
            num_threads=setup.num_threads,
            max_num_seqs=64,
            max_num_kv_tokens=setup.num_kv_tokens,
            num_scheduler_steps=NUM_SCHEDULER_STEPS,
        )

    def describe(self) -> str:
        loaded = self.llm.engine.loaded
        mlp = " ".join(repr(loaded.model.model.layers[0].mlp).split())
        return f"{loaded.num_bytes / 2**20:.0f} MiB of weights; layer 0: {mlp}"

    def single(self, ids: list[int], max_tokens: int) -> dict[str, object]:
        from tokenriver import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.llm.reset_prefix_cache()  # Else the prompt of the previous repeat would be a cache hit.
        (output,) = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        metrics, tokens = output.metrics, output.outputs[0].token_ids
        per_token = metrics.time_per_output_token(len(tokens))
        return {
            "first_token_s": metrics.first_token_time - metrics.arrival_time,
            "decode_tokens_per_s": None if per_token is None else 1 / per_token,
            "token_ids": tokens,
        }

    def throughput(self, prompts: list[list[int]], max_tokens: int, batch_size: int) -> float:
        """All prompts at once: the scheduler batches them (batch_size is transformers' knob)."""
        from tokenriver import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.llm.reset_prefix_cache()  # Shared prefixes are computed once per run, not taken from the last run.
        started = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed

    def score(self, ids: list[int]) -> dict[str, object]:
        """Perplexity of ids[1:] and the most likely token at each position, from the engine's prompt logprobs."""
        from tokenriver import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        self.llm.reset_prefix_cache()  # Prompt logprobs need every position computed.
        (output,) = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        positions = output.prompt_logprobs[1:]
        argmax = [next(token_id for token_id, lp in position.items() if lp.rank == 1) for position in positions]
        return _scored([position[token_id].logprob for token_id, position in zip(ids[1:], positions)], argmax)


class LlamaCppEngine:
    def __init__(self, setup: Setup) -> None:
        from llama_cpp import Llama

        self.setup = setup
        self.llm = Llama(
            model_path=setup.model_path,
            n_ctx=2048,
            n_batch=512,
            n_threads=setup.num_threads,
            n_threads_batch=setup.num_threads,
            verbose=False,
        )

    def describe(self) -> str:
        import llama_cpp

        return llama_cpp.llama_print_system_info().decode().strip()

    def single(self, ids: list[int], max_tokens: int) -> dict[str, object]:
        self.llm.reset()  # Else generate() reuses the KV of a matching prefix from the previous run.
        times, tokens = [], []
        started = time.perf_counter()
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            times.append(time.perf_counter())
            tokens.append(token)
            if len(tokens) == max_tokens:
                break
        return _greedy_run(times, started, tokens)

    def score(self, ids: list[int]) -> dict[str, object]:
        """Needs logits at every position: a second context, created after the worker's RSS was read."""
        import numpy as np
        from llama_cpp import Llama

        setup = self.setup
        scorer = Llama(
            model_path=setup.model_path,
            n_ctx=len(ids) + 16,
            n_batch=512,
            n_threads=setup.num_threads,
            n_threads_batch=setup.num_threads,
            logits_all=True,
            verbose=False,
        )
        scorer.eval(ids)
        logits = np.asarray(scorer.scores[: len(ids) - 1], dtype=np.float64)  # [len(ids) - 1, vocab]
        top = logits.max(axis=1, keepdims=True)  # [len(ids) - 1, 1]
        log_norm = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]  # [len(ids) - 1]
        targets = logits[np.arange(len(ids) - 1), ids[1:]]  # [len(ids) - 1]
        return _scored((targets - log_norm).tolist(), logits.argmax(axis=1).tolist())


class TransformersEngine:
    def __init__(self, setup: Setup) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(setup.num_threads)
        directory, name = os.path.split(setup.model_path)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=name, dtype=getattr(torch, setup.spec.dtype)
        )
        self.model.eval()
        eos = self.model.generation_config.eos_token_id
        self.pad_id = eos[0] if isinstance(eos, list) else eos

    def describe(self) -> str:
        projection = self.model.model.layers[0].mlp.gate_proj
        return f"layer 0 gate_proj: {type(projection).__name__}, weight {projection.weight.dtype}"

    def single(self, ids: list[int], max_tokens: int) -> dict[str, object]:
        from transformers.generation.streamers import BaseStreamer

        class TokenClock(BaseStreamer):
            """Timestamps every generated token; generate()'s first put() is the prompt."""

            def __init__(self) -> None:
                self.times: list[float] = []
                self.has_prompt = False

            def put(self, value) -> None:  # type: ignore[no-untyped-def]
                if self.has_prompt:
                    self.times.append(time.perf_counter())
                self.has_prompt = True

            def end(self) -> None:
                pass

        clock = TokenClock()
        input_ids = self.torch.tensor([ids])  # [1, prompt_len]
        with self.torch.inference_mode():
            started = time.perf_counter()
            out = self.model.generate(
                input_ids,
                attention_mask=self.torch.ones_like(input_ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.pad_id,
                streamer=clock,
            )
        return _greedy_run(clock.times, started, out[0, len(ids) :].tolist())

    def throughput(self, prompts: list[list[int]], max_tokens: int, batch_size: int) -> float:
        """Left-padded batches of batch_size through generate, exactly max_tokens new tokens each."""
        torch = self.torch
        generated = 0
        started = time.perf_counter()
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            width = max(len(p) for p in batch)
            input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in batch])  # [batch, width]
            attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])  # [batch, width]
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids,
                    attention_mask=attention_mask,
                    max_new_tokens=max_tokens,
                    min_new_tokens=max_tokens,
                    do_sample=False,
                    pad_token_id=self.pad_id,
                )
            generated += (out.shape[1] - width) * len(batch)
        return generated / (time.perf_counter() - started)

    def score(self, ids: list[int]) -> dict[str, object]:
        torch = self.torch
        with torch.inference_mode():
            logits = self.model(torch.tensor([ids])).logits[0, :-1].float()  # [len(ids) - 1, vocab]
        log_probs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])  # [len(ids) - 1, 1]
        return _scored(log_probs[:, 0].tolist(), logits.argmax(-1).tolist())


ENGINES = {"tokenriver": TokenriverEngine, "llama.cpp": LlamaCppEngine, "transformers": TransformersEngine}


def rss_mib() -> dict[str, float]:
    """This process's peak resident set (ru_maxrss, KiB on Linux) and its current one (VmRSS)."""
    current = next(
        (
            float(line.split()[1])
            for line in Path("/proc/self/status").read_text().splitlines()
            if line.startswith("VmRSS:")
        ),
        0.0,
    )
    return {"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "current": current / 1024}


def serve_worker(setup: Setup) -> None:
    """Build the engine, then answer one JSON command per stdin line with one JSON line on the original stdout.

    Anything a library prints (llama.cpp's C logs, transformers' warnings) goes to stderr, which the parent logs.
    """
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    engine = ENGINES[setup.spec.kind](setup)
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "quit":
            break
        result = rss_mib() if op == "rss" else getattr(engine, op)(**command)
        replies.write(json.dumps({"result": result}) + "\n")
        replies.flush()


def cold_start(setup: Setup, ids: list[int]) -> None:
    """A fresh process's path to its first token: imports, load, one greedy token. Prints time.time() then."""
    ENGINES[setup.spec.kind](setup).single(ids, 1)
    print(json.dumps({"first_token_time": time.time()}))


def _setup_from_json(text: str) -> Setup:
    fields = json.loads(text)
    return Setup(**{**fields, "spec": EngineSpec(**fields["spec"])})


# ---------------------------------------------------------------------------------------------------------------
# The parent: prompts, workers, interleaved measurements.


def child_env(num_threads: int) -> dict[str, str]:
    source = str(BENCHMARKS.parent / "src")
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(num_threads),
        "MKL_NUM_THREADS": str(num_threads),
        "PYTHONPATH": source if not path else f"{source}{os.pathsep}{path}",
        "TOKENIZERS_PARALLELISM": "false",
    }


class Worker:
    """A worker process and its command channel."""

    def __init__(self, setup: Setup, log_dir: Path) -> None:
        self.spec = setup.spec
        self.log_path = log_dir / f"{setup.spec.label.replace(' ', '_').replace('/', '_')}.log"
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(asdict(setup))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=child_env(setup.num_threads),
        )

    def reply(self) -> dict[str, object]:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(
                f"worker {self.spec.label} exited (code {self.process.returncode}); "
                f"its log {self.log_path} ends with:\n{tail}"
            )
        return json.loads(line)

    def call(self, op: str, **arguments: object) -> object:
        time.sleep(SETTLE_SECONDS)
        self.process.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self.process.stdin.flush()
        return self.reply()["result"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.process.stdin.flush()
            self.process.wait(timeout=60)
        self.log.close()


def engine_specs(hf_dtypes: list[str]) -> list[EngineSpec]:
    specs = [
        EngineSpec(INT4, "tokenriver", "float32", "auto"),
        EngineSpec(INT4_X8, "tokenriver", "float32", "auto", int8_activations=True, kv_cache_dtype="float16"),
        EngineSpec(INT4_X8_KV8, "tokenriver", "float32", "auto", int8_activations=True, kv_cache_dtype="int8"),
        EngineSpec("tokenriver int8", "tokenriver", "float32", "int8"),
        EngineSpec(INT8_X8_KV8, "tokenriver", "float32", "int8", int8_activations=True, kv_cache_dtype="int8"),
        EngineSpec("tokenriver bf16", "tokenriver", "bfloat16", "none"),
        EngineSpec(REFERENCE, "tokenriver", "float32", "none"),
        EngineSpec(LLAMA, "llama.cpp"),
    ]
    return specs + [
        EngineSpec(f"transformers {'bf16' if d == 'bfloat16' else d}", "transformers", d) for d in hf_dtypes
    ]


def build_prompts(model_path: str, settings: Settings) -> dict[str, object]:
    """The token ids every engine gets, from tokenriver's tokenizer (llama.cpp and transformers take ids)."""
    from common import prompt_ids
    from throughput import make_prompts
    from tokenriver.loader.load import load_model

    tokenizer = load_model(model_path).tokenizer
    chat = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_MESSAGE}])
    text = tokenizer.encode(PERPLEXITY_TEXT.read_text())
    return {
        "chat": tokenizer.encode(chat, add_special_tokens=False),
        "long": prompt_ids(tokenizer, LONG_PROMPT_TOKENS),
        "batch": make_prompts(tokenizer, max(settings.throughput_prompts)),
        "text": text[: settings.perplexity_tokens] if settings.perplexity_tokens else text,
    }


def kv_tokens_needed(prompts: dict, settings: Settings, block_size: int = 16) -> int:
    """The largest workload's KV footprint in whole blocks per sequence, with 10% room."""

    def blocks(num_tokens: int) -> int:
        return -(-num_tokens // block_size)

    longest_batch = max(len(p) for p in prompts["batch"]) + settings.max_tokens
    needed = max(
        max(settings.throughput_prompts) * blocks(longest_batch),
        blocks(len(prompts["long"]) + settings.max_tokens),
        blocks(len(prompts["text"]) + 1),
    )
    return int(needed * 1.1 + 1) * block_size


@dataclass
class Results:
    """Every sample by engine label then measure; medians are taken when reporting."""

    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    greedy_tokens: dict[str, list[int]] = field(default_factory=dict)
    memory_mib: dict[str, dict[str, float]] = field(default_factory=dict)
    scores: dict[str, dict[str, object]] = field(default_factory=dict)
    descriptions: dict[str, str] = field(default_factory=dict)
    prompt_lengths: dict[str, int] = field(default_factory=dict)
    num_kv_tokens: int = 0

    def add(self, label: str, measure: str, value: float | None) -> None:
        if value is not None:
            self.samples.setdefault(label, {}).setdefault(measure, []).append(value)

    def median(self, label: str, measure: str) -> float | None:
        values = self.samples.get(label, {}).get(measure)
        return statistics.median(values) if values else None


def measure_single_stream(workers: list[Worker], prompts: dict, settings: Settings, results: Results) -> None:
    for repeat in range(settings.repeats):
        for worker in workers:
            run = worker.call("single", ids=prompts["chat"], max_tokens=settings.max_tokens)
            results.add(worker.spec.label, "decode_chat", run["decode_tokens_per_s"])
            results.greedy_tokens.setdefault(worker.spec.label, run["token_ids"])
        for worker in workers:
            run = worker.call("single", ids=prompts["long"], max_tokens=settings.max_tokens)
            results.add(worker.spec.label, "decode_long", run["decode_tokens_per_s"])
            results.add(worker.spec.label, "prefill", len(prompts["long"]) / run["first_token_s"])
        print(f"single stream: repeat {repeat + 1}/{settings.repeats} done", file=sys.stderr)


def measure_throughput(workers: list[Worker], prompts: dict, settings: Settings, results: Results) -> None:
    """Each (prompt count, batch size) is one measure; an engine's figure is its best batch size's median."""
    batched = [w for w in workers if hasattr(ENGINES[w.spec.kind], "throughput")]
    for repeat in range(settings.throughput_repeats):
        for count in settings.throughput_prompts:
            for worker in batched:
                batch_sizes = (
                    [count]
                    if worker.spec.kind == "tokenriver"
                    else [b for b in settings.hf_batch_sizes if b <= count] or [count]
                )
                for batch_size in batch_sizes:
                    rate = worker.call(
                        "throughput",
                        prompts=prompts["batch"][:count],
                        max_tokens=settings.max_tokens,
                        batch_size=batch_size,
                    )
                    results.add(worker.spec.label, f"throughput_{count}_batch_{batch_size}", rate)
        print(f"throughput: repeat {repeat + 1}/{settings.throughput_repeats} done", file=sys.stderr)
    for worker in batched:
        label = worker.spec.label
        for count in settings.throughput_prompts:
            prefix = f"throughput_{count}_batch_"
            rate, batch_size = max(
                (results.median(label, m), int(m.removeprefix(prefix)))
                for m in results.samples[label]
                if m.startswith(prefix)
            )
            results.samples[label][f"throughput_{count}"] = [rate]
            results.samples[label][f"throughput_{count}_best_batch"] = [batch_size]


def measure_cold_starts(setups: list[Setup], prompts: dict, settings: Settings, results: Results) -> None:
    """Fresh processes, alternating engines; then `tokenriver generate` to its first byte of output."""
    num_threads = setups[0].num_threads
    # What an install leaves behind: the package's modules byte-compiled, so no start compiles them from source.
    compileall.compile_dir(os.path.dirname(importlib.util.find_spec("tokenriver").origin), quiet=1)
    cli = [
        sys.executable,
        "-m",
        "tokenriver.cli",
        "generate",
        "Once upon a time",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--threads",
        str(num_threads),
    ]
    for _ in range(settings.cold_starts):
        for setup in setups:
            time.sleep(SETTLE_SECONDS)
            started = time.time()
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--cold-start",
                    json.dumps(asdict(setup)),
                    "--ids",
                    json.dumps(prompts["chat"]),
                ],
                capture_output=True,
                text=True,
                env=child_env(num_threads),
            )
            if done.returncode:
                raise RuntimeError(f"cold start of {setup.spec.label} failed:\n{done.stderr[-3000:]}")
            first_token_time = json.loads(done.stdout.strip().splitlines()[-1])["first_token_time"]
            results.add(setup.spec.label, "cold_start_s", first_token_time - started)
        time.sleep(SETTLE_SECONDS)
        started = time.time()
        process = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=child_env(num_threads))
        process.stdout.read(1)
        results.add(CLI, "cold_start_s", time.time() - started)
        process.wait()
    print("cold starts done", file=sys.stderr)


def run(args: argparse.Namespace, settings: Settings) -> Results:
    from tokenriver.loader.load import default_model_path

    model_path = default_model_path()
    prompts = build_prompts(model_path, settings)
    results = Results(num_kv_tokens=kv_tokens_needed(prompts, settings))
    results.prompt_lengths = {name: len(prompts[name]) for name in ("chat", "long", "text")}
    setups = [Setup(spec, model_path, args.threads, results.num_kv_tokens) for spec in engine_specs(args.hf_dtypes)]
    log_dir = Path(tempfile.mkdtemp(prefix="vs_llamacpp_logs_"))
    print(f"worker logs: {log_dir}", file=sys.stderr)
    workers = [Worker(setup, log_dir) for setup in setups]
    try:
        for worker in workers:
            worker.reply()
        for worker in workers:  # Warm-up: first-call costs (allocations, kernel binding) are not measured.
            results.descriptions[worker.spec.label] = worker.call("describe")
            worker.call("single", ids=prompts["chat"], max_tokens=4)
        print("workers ready", file=sys.stderr)
        measure_single_stream(workers, prompts, settings, results)
        measure_throughput(workers, prompts, settings, results)
        for worker in workers:
            results.memory_mib[worker.spec.label] = worker.call("rss")
        for worker in workers:
            results.scores[worker.spec.label] = worker.call("score", ids=prompts["text"])
    finally:
        for worker in workers:
            worker.close()
    measure_cold_starts(setups, prompts, settings, results)
    return results


# ---------------------------------------------------------------------------------------------------------------
# Report


def _fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _ratio(value: float | None, base: float | None, digits: int = 2) -> str:
    return "—" if value is None or not base else f"{value / base:.{digits}f}x"


def _met(condition: bool) -> str:
    return "yes" if condition else "**no**"


def common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def goal_rows(
    results: Results, labels: list[str], hf_best: dict[int, float | None], counts: tuple[int, ...], settings: Settings
) -> list[list[str]]:
    """Issue 8's targets, checked against this run: the throughput ones at every prompt count measured (the issue
    names 32 and 64)."""
    med = results.median
    ours = [label for label in labels if label.startswith("tokenriver")]
    best_prefill = max(med(label, "prefill") or 0.0 for label in ours)
    throughput_rows = []
    for count in counts:
        best_rate = max(med(label, f"throughput_{count}") or 0.0 for label in ours)
        workload = f"throughput {count} x {settings.max_tokens}"
        throughput_rows += [
            [
                f"{workload} ≥ 2x vLLM CPU ({VLLM_CPU_BATCH32:.0f} tokens/s), best format",
                _ratio(best_rate, VLLM_CPU_BATCH32),
                _met(best_rate >= 2 * VLLM_CPU_BATCH32),
            ],
            [
                f"{workload} ≥ 4x transformers' best batch, best format",
                _ratio(best_rate, hf_best[count]),
                _met(best_rate >= 4 * (hf_best[count] or float("inf"))),
            ],
        ]
    llama_decode = med(LLAMA, "decode_chat")
    decode, decode_label = max((med(label, "decode_chat") or 0.0, label) for label in (INT4, INT4_X8))
    cli = med(CLI, "cold_start_s")
    infinite = float("inf")
    return [
        [
            "single-stream decode ≥ 1.5x llama.cpp (4-bit, after the chat prompt)",
            f"{_ratio(decode, llama_decode)} ({decode_label}); exact int4 "
            f"{_ratio(med(INT4, 'decode_chat'), llama_decode)}",
            _met(decode >= 1.5 * (llama_decode or infinite)),
        ],
        [
            "prefill of 512 tokens ≥ 3x llama.cpp (best tokenriver format)",
            _ratio(best_prefill, med(LLAMA, "prefill")),
            _met(best_prefill >= 3 * (med(LLAMA, "prefill") or infinite)),
        ],
        *throughput_rows,
        [
            "`tokenriver generate` cold start to first token ≤ 3 s (median)",
            f"{_fmt(cli, 2)} s",
            _met((cli or infinite) <= 3),
        ],
    ]


def report(
    results: Results, specs: list[EngineSpec], settings: Settings, args: argparse.Namespace, command: str
) -> str:
    import llama_cpp
    import transformers

    from common import machine_line, markdown_table, rounded_products

    labels = [s.label for s in specs]
    hf_labels = [s.label for s in specs if s.kind == "transformers"]
    med = results.median
    lengths = results.prompt_lengths
    counts = settings.throughput_prompts

    single_rows = []
    for label in labels:
        row = [label]
        for measure in ("decode_chat", "decode_long", "prefill"):
            row += [_fmt(med(label, measure)), _ratio(med(label, measure), med(LLAMA, measure))]
        single_rows.append(row)

    hf_best = {
        count: max((med(label, f"throughput_{count}") or 0.0) for label in hf_labels) or None for count in counts
    }
    throughput_rows = []
    for label in labels:
        if med(label, f"throughput_{counts[0]}") is None:
            continue
        row = [label]
        for count in counts:
            rate = med(label, f"throughput_{count}")
            batch = f" (batch {med(label, f'throughput_{count}_best_batch'):.0f})" if label in hf_labels else ""
            row += [_fmt(rate) + batch, _ratio(rate, hf_best[count]), _ratio(rate, VLLM_CPU_BATCH32)]
        throughput_rows.append(row)

    resource_rows = []
    for label in labels + [CLI]:
        cold = results.samples.get(label, {}).get("cold_start_s", [])
        rss = results.memory_mib.get(label, {})
        resource_rows.append(
            [
                label,
                _fmt(rss.get("peak"), 0),
                _fmt(rss.get("current"), 0),
                _fmt(med(label, "cold_start_s"), 2),
                _fmt(cold[0] if cold else None, 2),
            ]
        )

    reference = results.scores.get(REFERENCE, {})
    reference_tokens = results.greedy_tokens.get(REFERENCE, [])
    quality_rows = []
    for label in labels:
        score = results.scores.get(label, {})
        agreement = sum(a == b for a, b in zip(score.get("argmax", []), reference.get("argmax", []))) / max(
            1, len(reference.get("argmax", []))
        )
        quality_rows.append(
            [
                label,
                _fmt(score.get("perplexity"), 3),
                _ratio(score.get("perplexity"), reference.get("perplexity"), 4),
                f"{agreement:.1%}",
                f"{common_prefix(results.greedy_tokens.get(label, []), reference_tokens)} / {len(reference_tokens)}",
            ]
        )

    notes = [f"- {label}: {text}" for label, text in results.descriptions.items() if text]
    lines = [
        "# tokenriver vs llama.cpp vs transformers",
        "",
        f"Embedded SmolLM2-135M-Instruct (Q4_1 GGUF), {args.threads} threads for every engine, greedy. "
        f"Machine: {machine_line()}; llama-cpp-python {llama_cpp.__version__}, transformers "
        f"{transformers.__version__}. With int8 activations, products of more than 10 rows run as "
        f"{rounded_products()}. tokenriver runs with num_scheduler_steps={NUM_SCHEDULER_STEPS} (multi-step "
        f"scheduling).",
        f"Command: `{command}`",
        "",
        f"Each engine configuration runs in its own process; measurements alternate between them (A, B, C, A, B, "
        f"C...) and the median is shown: {settings.repeats} repeats single-stream, {settings.throughput_repeats} "
        f"for throughput, {settings.cold_starts} cold starts. Every engine gets the same token ids: a "
        f"{lengths['chat']}-token chat prompt, a {lengths['long']}-token text, chat prompts for throughput; "
        f"{settings.max_tokens} generated tokens each (EOS ignored).",
        "",
        "![results](vs_llamacpp.png)",
        "",
        "## Goals (issue 8)",
        "",
        markdown_table(["goal", "measured", "met"], goal_rows(results, labels, hf_best, counts, settings)),
        "",
        "## Single stream (tokens/s; ratio to llama.cpp)",
        "",
        markdown_table(
            [
                "engine",
                "decode after chat prompt",
                "vs llama.cpp",
                f"decode after {lengths['long']}-token prompt",
                "vs llama.cpp",
                f"prefill {lengths['long']} tokens",
                "vs llama.cpp",
            ],
            single_rows,
        ),
        "",
        "Decode: generated tokens after the first / time from the first to the last. Prefill: prompt tokens / time "
        "to the first generated token.",
        "",
        "## Offline throughput (generated tokens/s)",
        "",
        markdown_table(
            ["engine"]
            + [
                header
                for count in counts
                for header in (
                    f"{count} prompts x {settings.max_tokens}",
                    "vs transformers' best",
                    f"vs vLLM CPU {VLLM_CPU_BATCH32:.0f}",
                )
            ],
            throughput_rows,
        ),
        "",
        "tokenriver: all prompts submitted at once (continuous batching, max_num_seqs=64; prefix caching on, its "
        "cache emptied before each run, so the prompts share only the chat template's system prompt with each "
        "other). transformers: left-padded `generate` batches, best of batch sizes "
        f"{list(settings.hf_batch_sizes)} (in brackets). "
        "llama.cpp: not measured (llama-cpp-python runs one sequence at a time). vLLM's figure is its CPU build at "
        "batch 32 in bf16, measured in issue 8 on a 2-core AMD EPYC (Zen 4), not in this run nor necessarily on "
        "this machine.",
        "",
        "## Memory and start-up",
        "",
        markdown_table(
            [
                "engine",
                "peak RSS (MiB)",
                "RSS at the end (MiB)",
                "cold start to first token (s, median)",
                "first cold start (s)",
            ],
            resource_rows,
        ),
        "",
        f"Peak RSS: ru_maxrss of the engine's worker process after every measurement above (loading, Python and its "
        f"imports included); RSS at the end: its VmRSS then, what the engine keeps. tokenriver's KV pool holds "
        f"{results.num_kv_tokens} tokens ({max(counts)} sequences of the throughput workload); llama.cpp's context "
        "2,048 tokens of one sequence; transformers' cache grows with its batch. "
        f"Cold start: a fresh process from its start to its first generated token (imports, model load, chat "
        f"prompt); the CLI row is `tokenriver generate` (default settings) to its first byte of output.",
        "",
        "## Quality",
        "",
        markdown_table(
            [
                "engine",
                "perplexity",
                "vs tokenriver float32",
                "top-1 agreement with float32",
                "greedy tokens equal to float32's",
            ],
            quality_rows,
        ),
        "",
        f"Perplexity over the {lengths['text']} tokens of tests/data/perplexity_text.md (the text of "
        "tests/models/test_quant_perplexity.py). Top-1 agreement: share of its positions where the engine's most "
        "likely next token is tokenriver float32's. Greedy: the common prefix of the tokens generated after the chat "
        "prompt with tokenriver float32's (where two candidates are nearly tied, one flip changes the rest).",
        "",
        "## Engines as loaded",
        "",
        *notes,
        "",
    ]
    return "\n".join(lines)


def plot(results: Results, specs: list[EngineSpec], settings: Settings, path: Path, threads: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [s.label for s in specs]
    colors = {label: plt.get_cmap("tab10")(index) for index, label in enumerate(labels)}
    panels = [
        (
            "single-stream decode (tokens/s)",
            [("chat prompt", "decode_chat"), (f"{results.prompt_lengths['long']}-token prompt", "decode_long")],
        ),
        (f"prefill, {results.prompt_lengths['long']} tokens (tokens/s)", [("", "prefill")]),
        (
            "offline throughput (tokens/s)",
            [(f"{c} x {settings.max_tokens}", f"throughput_{c}") for c in settings.throughput_prompts],
        ),
    ]
    figure, axes = plt.subplots(1, 4, figsize=(18, 4.8))
    width = 0.8 / len(labels)
    for axis, (title, groups) in zip(axes, panels):
        for index, label in enumerate(labels):
            values = [results.median(label, measure) or 0.0 for _, measure in groups]
            positions = [group + (index - (len(labels) - 1) / 2) * width for group in range(len(groups))]
            axis.bar(positions, values, width, color=colors[label], label=label)
        axis.set_xticks(range(len(groups)), [name for name, _ in groups])
        axis.set_title(title)
        axis.grid(axis="y", alpha=0.3)
    axes[2].axhline(VLLM_CPU_BATCH32, color="gray", linestyle="--", label="vLLM CPU, batch 32 (issue 8)")
    axes[3].barh(
        range(len(labels)),
        [results.memory_mib.get(label, {}).get("peak", 0.0) for label in labels],
        color=[colors[label] for label in labels],
    )
    axes[3].set_yticks(range(len(labels)), labels)
    axes[3].invert_yaxis()
    axes[3].set_title("peak RSS (MiB)")
    axes[3].grid(axis="x", alpha=0.3)
    handles, names = axes[2].get_legend_handles_labels()
    figure.legend(handles, names, loc="lower center", ncol=len(names), fontsize=8)
    figure.suptitle(f"SmolLM2-135M (Q4_1 GGUF), {threads} threads, same run")
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(path, dpi=110)


def settings_from(args: argparse.Namespace) -> Settings:
    if args.quick:
        return Settings(
            repeats=1,
            throughput_repeats=1,
            max_tokens=16,
            throughput_prompts=(4, 8),
            hf_batch_sizes=(8,),
            perplexity_tokens=256,
            cold_starts=1,
        )
    return Settings(
        repeats=args.repeats,
        throughput_repeats=args.throughput_repeats,
        max_tokens=128,
        throughput_prompts=(32, 64),
        hf_batch_sizes=tuple(args.hf_batch_sizes),
        perplexity_tokens=None,
        cold_starts=args.cold_starts,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="threads of every engine (default: 2)")
    parser.add_argument("--repeats", type=int, default=3, help="single-stream repeats (default: 3)")
    parser.add_argument(
        "--throughput-repeats", type=int, default=1, help="throughput repeats (default: 1; each adds ~10 minutes)"
    )
    parser.add_argument("--cold-starts", type=int, default=3, help="cold starts per engine (default: 3)")
    parser.add_argument(
        "--hf-batch-sizes",
        type=int,
        nargs="+",
        default=[32, 64],
        help="transformers' batch sizes tried for throughput; the best counts (default: 32 64)",
    )
    parser.add_argument("--hf-dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 16 tokens, 1 repeat, 4 and 8 prompts; writes to a temporary folder",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="where the .md and .png go (default: benchmarks/results, or a temporary folder with --quick)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cold-start", help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        serve_worker(_setup_from_json(args.worker))
        return
    if args.cold_start:
        cold_start(_setup_from_json(args.cold_start), json.loads(args.ids))
        return

    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(BENCHMARKS))
    from common import RESULTS

    settings = settings_from(args)
    out_dir = args.out_dir or (Path(tempfile.mkdtemp(prefix="vs_llamacpp_quick_")) if args.quick else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python benchmarks/vs_llamacpp.py", shlex.join(sys.argv[1:])]).strip()
    started = time.time()
    results = run(args, settings)
    specs = engine_specs(args.hf_dtypes)
    plot(results, specs, settings, out_dir / "vs_llamacpp.png", args.threads)
    text = report(results, specs, settings, args, command)
    text += f"\nWall time of this run: {(time.time() - started) / 60:.1f} min.\n"
    (out_dir / "vs_llamacpp.md").write_text(text)
    print(text)
    print(f"wrote {out_dir / 'vs_llamacpp.md'} and {out_dir / 'vs_llamacpp.png'}", file=sys.stderr)


if __name__ == "__main__":
    main()
