"""Single-stream speed: tokenriver vs Hugging Face transformers on the same weights, same run, 2 threads.

Measures prefill tokens/s (a 512-token prompt) and decode tokens/s (128 greedy tokens), alternating the two engines
to cancel machine drift, and the time per generated token with and without the KV cache at 128..1024 tokens of
context (the cache turns O(n²) into O(n)). Writes benchmarks/results/single_stream.md and single_stream_kv_cache.png.

    python benchmarks/single_stream.py [--dtype float32|bfloat16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from common import RESULTS, machine_line, markdown_table, prompt_ids
from tokenriver import LLM, SamplingParams
from tokenriver.loader.load import default_model_path, load_model

PREFILL_TOKENS = 512
DECODE_TOKENS = 128
CONTEXTS = (128, 256, 512, 1024)


def tokenriver_run(llm: LLM, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """(prefill seconds, seconds per decoded token) from the engine's own request timings."""
    started = time.perf_counter()
    (output,) = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    elapsed = time.perf_counter() - started
    metrics = output.metrics
    prefill = metrics.first_token_time - metrics.arrival_time
    per_token = metrics.time_per_output_token(len(output.outputs[0].token_ids)) or elapsed
    return prefill, per_token


def transformers_run(model, ids: list[int], max_tokens: int) -> tuple[float, float]:
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        started = time.perf_counter()
        model.generate(input_ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        model.generate(input_ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        total = time.perf_counter() - started
    return prefill, (total - prefill) / (max_tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="tokenriver's weights: auto keeps the file's Q4_1 packed, none dequantizes to --dtype",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    path = default_model_path()
    loaded = load_model(path, dtype=args.dtype, quantization=args.quantization)
    # No prefix caching: every repeat must prefill its prompt for real.
    llm = LLM.from_loaded(loaded, num_threads=args.threads, max_num_kv_tokens=4096, enable_prefix_caching=False)
    directory, name = os.path.split(path)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=getattr(torch, args.dtype))
    hf_model.eval()
    long_prompt = prompt_ids(loaded.tokenizer, PREFILL_TOKENS)
    short_prompt = prompt_ids(loaded.tokenizer, 16)

    tokenriver_runs = {"prefill": [], "decode": []}
    hf_runs = {"prefill": [], "decode": []}
    tokenriver_run(llm, short_prompt, 8)
    transformers_run(hf_model, short_prompt, 8)
    for _ in range(args.repeats):
        for runs, run in (
            (tokenriver_runs, lambda ids, n: tokenriver_run(llm, ids, n)),
            (hf_runs, lambda ids, n: transformers_run(hf_model, ids, n)),
        ):
            prefill, _ = run(long_prompt, 2)
            runs["prefill"].append(PREFILL_TOKENS / prefill)
            _, per_token = run(short_prompt, DECODE_TOKENS)
            runs["decode"].append(1 / per_token)

    rows = []
    for label, key, unit in (
        ("prefill (512-token prompt)", "prefill", "tokens/s"),
        ("decode (128 tokens, greedy)", "decode", "tokens/s"),
    ):
        ours, theirs = statistics.median(tokenriver_runs[key]), statistics.median(hf_runs[key])
        rows.append([label, f"{ours:.1f} {unit}", f"{theirs:.1f} {unit}", f"{ours / theirs:.2f}x"])

    uncached = LLM.from_loaded(
        loaded, num_threads=args.threads, max_num_kv_tokens=4096, use_kv_cache=False, enable_prefix_caching=False
    )
    cache_rows, cached_ms, uncached_ms = [], [], []
    for context in CONTEXTS:
        ids = prompt_ids(loaded.tokenizer, context - 16)
        _, with_cache = tokenriver_run(llm, ids, 16)
        _, without_cache = tokenriver_run(uncached, ids, 16)
        cached_ms.append(with_cache * 1000)
        uncached_ms.append(without_cache * 1000)
        cache_rows.append(
            [context, f"{with_cache * 1000:.1f}", f"{without_cache * 1000:.1f}", f"{without_cache / with_cache:.1f}x"]
        )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(CONTEXTS, cached_ms, marker="o", label="with KV cache (O(n) per token)")
    axis.plot(CONTEXTS, uncached_ms, marker="o", label="without KV cache (recompute everything)")
    axis.set_xlabel("tokens of context")
    axis.set_ylabel("ms per generated token")
    axis.set_title(f"tokenriver, SmolLM2-135M {args.dtype}, {args.threads} threads")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    figure.savefig(RESULTS / "single_stream_kv_cache.png", dpi=120)

    report = [
        "# Single-stream speed: tokenriver vs transformers",
        "",
        f"Embedded SmolLM2-135M-Instruct (Q4_1 GGUF), compute dtype {args.dtype}; tokenriver weights: quantization "
        f"{args.quantization} (auto = Q4_1 kept packed), transformers: dequantized to {args.dtype}. "
        f"Median of {args.repeats} alternating runs. Machine: {machine_line()}.",
        f"Command: `python benchmarks/single_stream.py --dtype {args.dtype} --quantization {args.quantization}`",
        "",
        markdown_table(["measure", "tokenriver", "transformers", "ratio"], rows),
        "",
        "## Time per generated token vs context length",
        "",
        markdown_table(["context tokens", "with KV cache (ms)", "without KV cache (ms)", "cache speedup"], cache_rows),
        "",
        "![time per token with and without the KV cache](single_stream_kv_cache.png)",
        "",
    ]
    (RESULTS / "single_stream.md").write_text("\n".join(report))
    print("\n".join(report))


if __name__ == "__main__":
    main()
