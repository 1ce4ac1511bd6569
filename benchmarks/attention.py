"""Paged attention, one layer call: the native kernel against gather + SDPA.

Shapes of SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64, a float32 KV cache in blocks of 16 tokens. Each
request's block table is a random sample of the pool, as after many requests have come and gone. A call is what
the model does per layer: write this step's keys and values into their slots, then attend.

- "native": models/attention.py `paged_attention` on the native kernel (models/cpu/csrc/attention.cpp), which reads
  keys and values straight from the blocks.
- "torch": `paged_attention_torch`, the definition the native kernel stands in for: each request's blocks
  gathered (index_select), then one SDPA call per request.

Two measurements: decode steps (batch 1, 16, 64; contexts 128 to 2048) and one request's prompt chunk of 1 to 64
new tokens at the end of a longer context (the native kernel token by token, its chunk path, and SDPA on the
gathered context), which sets `MAX_KERNEL_QUERY_LEN`. Candidates are timed in interleaved rounds, so a load spike
from another process hits all alike; the best round ranks them (noise only adds time) and the median is shown
beside it. Caches are warm (the same pool every call), which flatters small contexts for every path alike.

    python benchmarks/attention.py [--repeats 7] [--threads 2] [--quick]

Writes benchmarks/results/attention.md and attention.png.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common import RESULTS, machine_line, markdown_table
from tokenriver.models.attention import paged_attention, paged_attention_torch
from tokenriver.models.attention_metadata import MAX_KERNEL_QUERY_LEN, AttentionMetadata
from tokenriver.models.cpu.kernels import load_kernels

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5
BATCHES = (1, 16, 64)
CONTEXTS = (128, 256, 512, 1024, 2048)
CHUNK_LENS = (1, 2, 4, 8, 16, 32, 64)
CHUNK_CONTEXTS = (128, 512, 2048)
ROUND_SECONDS = 0.05


def make_call(
    query_lens: list[int], seq_lens: list[int], native_query_len: int, rng: random.Random
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(native call, torch call) of one layer over a fresh pool; native_query_len as max_kernel_query_len."""
    blocks_per_request = [-(-seq_len // BLOCK_SIZE) for seq_len in seq_lens]
    num_blocks = sum(blocks_per_request) + 1
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables, start = [], 0
    for count in blocks_per_request:
        tables.append(pool[start : start + count])
        start += count
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kv_cache = (torch.randn(shape), torch.randn(shape))
    num_tokens = sum(query_lens)
    # [T, heads + 2 kv heads, head_dim]: q, k and v as views into one projection, as in the model.
    qkv = torch.randn(num_tokens, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM)
    query, key, value = qkv.split((NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS), dim=1)
    native = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, max_kernel_query_len=native_query_len)
    reference = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
    return (
        lambda: paged_attention(query, key, value, kv_cache, native, SCALE),
        lambda: paged_attention_torch(query, key, value, kv_cache, reference, SCALE),
    )


def measure(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, float]]:
    """(fastest, median) seconds per call of each candidate over interleaved rounds."""
    counts = {}
    for name, call in calls.items():
        call()
        started = time.perf_counter()
        call()
        counts[name] = max(1, int(ROUND_SECONDS / (time.perf_counter() - started)))
    rounds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            started = time.perf_counter()
            for _ in range(counts[name]):
                call()
            rounds[name].append((time.perf_counter() - started) / counts[name])
    return {name: (min(times), statistics.median(times)) for name, times in rounds.items()}


def measure_decode(
    batches: tuple[int, ...], contexts: tuple[int, ...], repeats: int, rng: random.Random
) -> dict[tuple[int, int], dict[str, tuple[float, float]]]:
    results = {}
    for batch in batches:
        for context in contexts:
            native, reference = make_call([1] * batch, [context] * batch, 1, rng)
            results[(batch, context)] = measure({"native": native, "torch": reference}, repeats)
            print(
                f"decode batch {batch} context {context}: "
                + ", ".join(f"{name} {best * 1e6:.1f} us" for name, (best, _) in results[(batch, context)].items()),
                flush=True,
            )
            del native, reference
    return results


def measure_chunks(
    chunk_lens: tuple[int, ...], contexts: tuple[int, ...], repeats: int, rng: random.Random
) -> dict[tuple[int, int], dict[str, tuple[float, float]]]:
    """One request: chunk_len new tokens ending a context; the native kernel token by token, its chunk path, and
    gather + SDPA."""
    results = {}
    for context in contexts:
        for chunk_len in chunk_lens:
            per_token, _ = make_call([chunk_len], [context], chunk_len, rng)
            chunk, sdpa = make_call([chunk_len], [context], 0, rng)
            results[(chunk_len, context)] = measure({"per token": per_token, "chunk": chunk, "SDPA": sdpa}, repeats)
            print(
                f"chunk {chunk_len} context {context}: "
                + ", ".join(f"{name} {best * 1e6:.1f} us" for name, (best, _) in results[(chunk_len, context)].items()),
                flush=True,
            )
    return results


def plot(decode: dict, chunks: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5))
    colors = plt.get_cmap("tab10")
    for index, batch in enumerate(sorted({b for b, _ in decode})):
        contexts = sorted(c for b, c in decode if b == batch)
        for name, style in (("native", "-"), ("torch", "--")):
            left.plot(
                contexts,
                [decode[(batch, c)][name][0] * 1e6 for c in contexts],
                style,
                marker="o",
                color=colors(index),
                label=f"batch {batch}, {name}",
            )
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("context tokens per request")
    left.set_ylabel("µs per layer call (best round)")
    left.set_title("Decode: native paged kernel (solid) vs gather + SDPA (dashed)")
    left.legend(fontsize=8)
    for index, context in enumerate(sorted({c for _, c in chunks})):
        lengths = sorted(q for q, c in chunks if c == context)
        for name, style in (("per token", ":"), ("chunk", "-"), ("SDPA", "--")):
            right.plot(
                lengths,
                [chunks[(q, context)][name][0] * 1e6 for q in lengths],
                style,
                marker="o",
                color=colors(index),
                label=f"context {context}, {name}",
            )
    right.axvline(MAX_KERNEL_QUERY_LEN, color="gray", linestyle=":", label="MAX_KERNEL_QUERY_LEN")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("new tokens in the chunk (one request)")
    right.set_ylabel("µs per layer call (best round)")
    right.set_title("Prompt chunk: native per token (dotted), native chunk (solid), SDPA (dashed)")
    right.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="fewer shapes, 3 repeats")
    parser.add_argument("--output", default=str(RESULTS / "attention.md"))
    args = parser.parse_args()
    if load_kernels() is None:
        raise SystemExit("the native kernels do not build on this machine; nothing to compare")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = random.Random(0)
    repeats = 3 if args.quick else args.repeats
    load_start = os.getloadavg()
    with torch.inference_mode():
        decode = measure_decode(BATCHES, CONTEXTS[::2] if args.quick else CONTEXTS, repeats, rng)
        chunks = measure_chunks(CHUNK_LENS, CHUNK_CONTEXTS[1:2] if args.quick else CHUNK_CONTEXTS, repeats, rng)
    load_end = os.getloadavg()

    decode_rows = [
        [
            batch,
            context,
            f"{r['native'][0] * 1e6:.1f}",
            f"{r['native'][1] * 1e6:.1f}",
            f"{r['torch'][0] * 1e6:.1f}",
            f"{r['torch'][1] * 1e6:.1f}",
            f"{r['torch'][0] / r['native'][0]:.1f}x",
        ]
        for (batch, context), r in decode.items()
    ]
    chunk_rows = [
        [
            context,
            chunk_len,
            f"{r['per token'][0] * 1e6:.1f}",
            f"{r['chunk'][0] * 1e6:.1f}",
            f"{r['chunk'][1] * 1e6:.1f}",
            f"{r['SDPA'][0] * 1e6:.1f}",
            f"{r['SDPA'][1] * 1e6:.1f}",
            f"{r['SDPA'][0] / r['chunk'][0]:.2f}x",
        ]
        for (chunk_len, context), r in sorted(chunks.items(), key=lambda item: (item[0][1], item[0][0]))
    ]
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    plot(decode, chunks, output.with_suffix(".png"))
    command = "python benchmarks/attention.py" + (" --quick" if args.quick else f" --repeats {args.repeats}")
    output.write_text(
        "\n\n".join(
            [
                "# Paged attention measurements",
                machine_line(),
                f"Command: `{command}`. {repeats} interleaved rounds; µs per layer call (write this step's K/V, then "
                f"attend), SmolLM2-135M shapes (9 heads, 3 KV heads, head_dim 64, float32 cache, blocks of 16, random "
                f"block tables). Load average (1 min) {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end.",
                f"![attention]({output.with_suffix('.png').name})",
                "## Decode (one new token per request)\n\n"
                "native = the paged kernel over the block tables; torch = gather the blocks with index_select, one "
                "masked SDPA call for the batch.\n\n"
                + markdown_table(
                    [
                        "batch",
                        "context",
                        "native µs (best)",
                        "native µs (median)",
                        "torch µs (best)",
                        "torch µs (median)",
                        "torch / native",
                    ],
                    decode_rows,
                ),
                "## One request's prompt chunk\n\n"
                "The chunk's tokens end a context of the given length. per token = the native kernel one query token "
                "at a time over the blocks; chunk = its prompt-chunk path (a block of query tokens per pass over each "
                "tile of keys, causal); SDPA = the path without native kernels: gather the context, one flash SDPA "
                f"call with a causal mask. Requests with at most MAX_KERNEL_QUERY_LEN = {MAX_KERNEL_QUERY_LEN} new "
                "tokens go token by token, longer ones as chunks.\n\n"
                + markdown_table(
                    [
                        "context",
                        "new tokens",
                        "per token µs (best)",
                        "chunk µs (best)",
                        "chunk µs (median)",
                        "SDPA µs (best)",
                        "SDPA µs (median)",
                        "SDPA / chunk",
                    ],
                    chunk_rows,
                ),
            ]
        )
        + "\n"
    )
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
