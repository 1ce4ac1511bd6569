"""Offline throughput: 64 prompts x 128 generated tokens, tokenriver vs transformers' padded `generate`.

Same weights, same dtype, same run, 2 threads. transformers runs at each batch size in --hf-batch-sizes and its
best is the reference. Every configuration runs --rounds times, the engines alternating within each round, and the
table reports medians with each round's figure: on a shared machine one run can be 20 % off the next.
Also: tokenriver's throughput vs the number of concurrent sequences (1, 4, 16, 64), and the time to first token of
a request whose 1,000-token prefix is already in the prefix cache vs not.
Writes benchmarks/results/throughput.md and throughput.png.

    python benchmarks/throughput.py [--dtype float32|bfloat16] [--num-prompts 64] [--max-tokens 128] [--rounds 2]
        [--int8-activations] [--kv-cache-dtype float16|int8] [--hf-dtypes float32 bfloat16]

--int8-activations runs tokenriver's rounded arithmetic (activations rounded to int8 per 32 columns in every
product); --hf-dtypes then lets
transformers run in bfloat16 too, in the same run, so that its best configuration in either dtype is the reference.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

from common import RESULTS, machine_line, markdown_table, prompt_ids, rounded_products
from tokenriver import LLM, SamplingParams
from tokenriver.loader.load import default_model_path, load_model

TOPICS = [
    "a lighthouse keeper",
    "the history of bread",
    "how rivers form",
    "a robot learning to paint",
    "the rules of chess",
    "volcanoes",
    "a trip to Kyoto",
    "why the sky is blue",
]


def make_prompts(tokenizer, count: int) -> list[list[int]]:
    """Chat prompts of varied length, deterministic."""
    rng = random.Random(0)
    prompts = []
    for index in range(count):
        topic = TOPICS[index % len(TOPICS)]
        detail = " Please be thorough." * rng.randint(0, 6)
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"Write about {topic}.{detail}"}])
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def tokenriver_throughput(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    return {
        "num_threads": args.threads,
        "kv_cache_memory": "2GiB",
        **({"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype else {}),
    }


def tokenriver_run(loaded, prompts: list[list[int]], args: argparse.Namespace, caching: bool) -> float:
    """One fresh engine with every prompt admitted at once, after a warm-up sharing no prefix with the prompts."""
    llm = LLM.from_loaded(loaded, max_num_seqs=args.num_prompts, enable_prefix_caching=caching, **engine_options(args))
    tokenriver_throughput(llm, [list(range(1000, 1040))], 8)
    return tokenriver_throughput(llm, prompts, args.max_tokens)


def transformers_throughput(model, tokenizer, prompts: list[list[int]], max_tokens: int, batch_size: int) -> float:
    """Left-padded batches through `generate`, exactly max_tokens new tokens each."""
    pad_id = tokenizer.eos_token_ids[0]
    generated = 0
    started = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        generated += (out.shape[1] - width) * len(batch)
    return generated / (time.perf_counter() - started)


def cached_prefix_ttft(loaded, num_prefix_tokens: int, repeats: int, options: dict[str, object]) -> tuple[float, float]:
    """Median time to first token for a prompt whose long prefix is cached vs the same prompt cold."""
    prefix = prompt_ids(loaded.tokenizer, num_prefix_tokens)
    cold, warm = [], []
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for index in range(repeats):
        llm = LLM.from_loaded(loaded, **{**options, "kv_cache_memory": None, "max_num_kv_tokens": 8192})
        question = loaded.tokenizer.encode(f" Question {index}: what comes next?")
        (first,) = llm.generate([{"prompt_token_ids": prefix + question}], params, use_tqdm=False)
        cold.append(first.metrics.time_to_first_token)
        other = loaded.tokenizer.encode(f" Question {index + 100}: and after that?")
        (second,) = llm.generate([{"prompt_token_ids": prefix + other}], params, use_tqdm=False)
        assert second.num_cached_tokens >= num_prefix_tokens - 16
        warm.append(second.metrics.time_to_first_token)
    return statistics.median(cold), statistics.median(warm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument(
        "--hf-dtypes",
        nargs="+",
        choices=["float32", "bfloat16"],
        default=None,
        help="transformers' dtypes, each at every batch size (default: --dtype)",
    )
    parser.add_argument(
        "--int8-activations",
        action="store_true",
        help="tokenriver's rounded arithmetic (4-bit weights; see models/quant.py)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["float32", "float16", "int8"],
        default=None,
        help="tokenriver's KV pool dtype (default: the engine's)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="runs of every configuration, engines alternating")
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="tokenriver's weights: auto keeps the file's Q4_1 packed, none dequantizes to --dtype",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    path = default_model_path()
    loaded = load_model(path, dtype=args.dtype, quantization=args.quantization, int8_activations=args.int8_activations)
    directory, name = os.path.split(path)
    hf_dtypes = args.hf_dtypes or [args.dtype]
    hf_models = {
        dtype: AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=getattr(torch, dtype))
        for dtype in hf_dtypes
    }
    for model in hf_models.values():
        model.eval()
    prompts = make_prompts(loaded.tokenizer, args.num_prompts)

    # The engine's defaults, prefix caching on: the prompts' shared chat-template prefix is computed once, as a
    # serving engine does (vLLM's too); and with it off, every prompt token computed, as transformers does.
    ours_rounds: dict[bool, list[float]] = {True: [], False: []}
    hf_rounds: dict[tuple[str, int], list[float]] = {
        (dtype, size): [] for dtype in hf_dtypes for size in args.hf_batch_sizes
    }
    for round_index in range(args.rounds):
        # Alternate which engine goes first, so drift over the run does not favour either.
        for engine in ("tokenriver", "transformers") if round_index % 2 == 0 else ("transformers", "tokenriver"):
            if engine == "tokenriver":
                for caching in (True, False):
                    ours_rounds[caching].append(tokenriver_run(loaded, prompts, args, caching))
            else:
                for dtype, size in hf_rounds:
                    hf_rounds[dtype, size].append(
                        transformers_throughput(hf_models[dtype], loaded.tokenizer, prompts, args.max_tokens, size)
                    )
        print(
            f"round {round_index + 1}: tokenriver {[round(r[-1], 1) for r in ours_rounds.values()]}, "
            f"transformers {[round(r[-1], 1) for r in hf_rounds.values()]}",
            flush=True,
        )
    ours = {caching: statistics.median(rates) for caching, rates in ours_rounds.items()}
    hf = {key: statistics.median(rates) for key, rates in hf_rounds.items()}
    best = max(hf, key=hf.get)

    concurrency_rows, concurrency = [], [1, 4, 16, 64]
    curve = []
    for num_seqs in concurrency:
        capped = LLM.from_loaded(loaded, max_num_seqs=num_seqs, enable_prefix_caching=False, **engine_options(args))
        count = max(num_seqs, min(args.num_prompts, 2 * num_seqs))
        rate = tokenriver_throughput(capped, prompts[:count], args.max_tokens if num_seqs > 1 else 64)
        curve.append(rate)
        concurrency_rows.append([num_seqs, f"{rate:.1f}"])

    cold, warm = cached_prefix_ttft(loaded, 1000, repeats=3, options=engine_options(args))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(concurrency, curve, marker="o", label="tokenriver")
    axis.axhline(hf[best], color="gray", linestyle="--", label=f"transformers {best[0]}, batch {best[1]}")
    axis.set_xscale("log", base=2)
    axis.set_xticks(concurrency, [str(c) for c in concurrency])
    axis.set_xlabel("concurrent sequences (max_num_seqs)")
    axis.set_ylabel("generated tokens/s")
    rounded = ", int8 activations" if args.int8_activations else ""
    axis.set_title(f"Offline throughput, SmolLM2-135M {args.dtype}{rounded}, {args.threads} threads", fontsize=9)
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    figure.savefig(RESULTS / "throughput.png", dpi=120)

    def each(rates: list[float]) -> str:
        return ", ".join(f"{rate:.1f}" for rate in rates)

    rows = [
        [
            f"tokenriver (continuous batching, {args.num_prompts} at once, prefix caching "
            f"{'on: the default' if caching else 'off'})",
            f"{rate:.1f}",
            each(ours_rounds[caching]),
            f"{rate / hf[best]:.2f}x",
        ]
        for caching, rate in ours.items()
    ]
    rows += [
        [
            f"transformers generate {dtype}, batch {size} (padded)",
            f"{rate:.1f}",
            each(hf_rounds[dtype, size]),
            f"{rate / hf[best]:.2f}x",
        ]
        for (dtype, size), rate in hf.items()
    ]
    arithmetic = (
        f"int8 activations in decode-sized products, larger ones {rounded_products()} (--int8-activations)"
        if args.int8_activations
        else "exact"
    )
    report = [
        "# Offline throughput: tokenriver vs transformers",
        "",
        f"{args.num_prompts} chat prompts x {args.max_tokens} generated tokens (greedy, ignore_eos), activations "
        f"{args.dtype}. Machine: {machine_line()}.",
        f"tokenriver weights: quantization {args.quantization} (auto = the file's Q4_1 kept packed), arithmetic "
        f"{arithmetic}, KV cache {args.kv_cache_dtype or 'the default dtype'}; transformers: the same GGUF "
        f"dequantized to {' and '.join(hf_dtypes)}.",
        f"Command: `{' '.join(['python benchmarks/throughput.py'] + sys.argv[1:])}`",
        "",
        markdown_table(
            ["engine", f"generated tokens/s (median of {args.rounds})", "each round", "vs transformers' best"], rows
        ),
        "",
        "## tokenriver throughput vs concurrent sequences",
        "",
        markdown_table(["max_num_seqs", "generated tokens/s"], concurrency_rows),
        "",
        "![throughput vs concurrency](throughput.png)",
        "",
        "## Time to first token with a cached 1,000-token prefix",
        "",
        markdown_table(
            ["prefix", "time to first token (ms)"],
            [
                ["not cached", f"{cold * 1000:.0f}"],
                ["cached (prefix cache hit)", f"{warm * 1000:.0f}"],
                ["speedup", f"{cold / warm:.1f}x"],
            ],
        ),
        "",
    ]
    (RESULTS / "throughput.md").write_text("\n".join(report))
    print("\n".join(report))


if __name__ == "__main__":
    main()
