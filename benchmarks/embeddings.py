"""Embedding throughput: tokenriver's defaults against llama.cpp's embedding mode on the same GGUF file, same run.

Inputs of 128 tokens, last-token pooling on both sides (a causal model's natural pooling), unit-length vectors:
- batch 1: one input per call, calls one after another (a client embedding as it goes);
- batch 64: 64 inputs in one call (an indexing job).
llama.cpp runs through llama-cpp-python (`Llama(embedding=True, pooling_type=LAST)`, whose `embed()` packs inputs
into one decode of up to n_batch tokens) with its defaults, n_ctx = n_batch = n_ubatch = 512: of the batch sizes
tried (up to 8192) the fastest for llama.cpp here. Each measurement runs in a fresh process, the two engines
alternating round after round. The table also gives the cosine between the two engines' vectors of the same input.

    python benchmarks/embeddings.py [--model PATH] [--rounds 5] [--threads 2]

Writes benchmarks/results/embeddings.md and embeddings.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import FILLER, RESULTS, machine_line, markdown_table

BATCHES = (1, 64)
NUM_TOKENS = 128
ENGINES = ("tokenriver", "llama.cpp")


def texts(tokenize, count: int) -> list[str]:
    """count different texts of NUM_TOKENS tokens each (by the engine's own tokenizer)."""
    result = []
    for index in range(count):
        words = f"Document {index}. {FILLER * 4}".split(" ")
        while len(tokenize(" ".join(words))) > NUM_TOKENS:
            words.pop()
        result.append(" ".join(words))
    return result


def measure_tokenriver(model: str | None, threads: int) -> dict:
    from tokenriver import LLM

    llm = LLM(model=model, num_threads=threads)
    tokenize = llm.get_tokenizer().encode
    return _measure(lambda batch: [o.embedding for o in llm.embed(batch, use_tqdm=False)], tokenize)


def measure_llamacpp(model: str, threads: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=model,
        embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_LAST,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    return _measure(lambda batch: llm.embed(batch, normalize=True), lambda text: llm.tokenize(text.encode()))


def _measure(embed, tokenize) -> dict:
    """Sequences per second at each batch size (best of three), the token counts, and two vectors to compare."""
    inputs = texts(tokenize, max(BATCHES))
    embed(inputs[:4])
    result: dict = {"num_tokens": [len(tokenize(text)) for text in inputs[:4]], "vectors": embed(inputs[:2])}
    for batch in BATCHES:
        best = 0.0
        for _ in range(3):
            started = time.perf_counter()
            if batch == 1:
                for text in inputs[:16]:
                    embed([text])
                count = 16
            else:
                embed(inputs[:batch])
                count = batch
            best = max(best, count / (time.perf_counter() - started))
        result[f"batch {batch}"] = best
    return result


def run(engine: str, model: str, threads: int) -> dict:
    """One measurement in a fresh process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, __file__, "--measure", engine, "--model", model, "--threads", str(threads)]
    output = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (sum(x * x for x in a) ** 0.5 * sum(y * y for y in b) ** 0.5)


def write_results(runs: dict, model: str, rounds: int, threads: int) -> None:
    rows = []
    for batch in BATCHES:
        key = f"batch {batch}"
        ours = [r[key] for r in runs["tokenriver"]]
        theirs = [r[key] for r in runs["llama.cpp"]]
        rows.append(
            [
                key,
                f"{statistics.median(ours):,.1f} ({min(ours):,.1f}-{max(ours):,.1f})",
                f"{statistics.median(theirs):,.1f} ({min(theirs):,.1f}-{max(theirs):,.1f})",
                f"{statistics.median(ours) / statistics.median(theirs):.2f}x",
            ]
        )
    first, second = runs["tokenriver"][0], runs["llama.cpp"][0]
    agreement = min(cosine(a, b) for a, b in zip(first["vectors"], second["vectors"]))
    table = markdown_table(
        ["inputs per call", "tokenriver: sequences/s (range)", "llama.cpp: sequences/s (range)", "ratio"], rows
    )
    text = (
        "# Embedding throughput\n\n"
        f"{machine_line()}\n\n"
        f"{Path(model).name}, {NUM_TOKENS}-token inputs (tokens per input as each engine counts them: tokenriver "
        f"{first['num_tokens']}, llama.cpp {second['num_tokens']}), last-token pooling, normalized, {threads} "
        f"threads, {rounds} rounds alternating, each in a fresh process; medians. "
        f"`python benchmarks/embeddings.py`.\n\n"
        f"{table}\n\n"
        f"Lowest cosine between the two engines' vectors of the same input: {agreement:.5f}.\n"
    )
    (RESULTS / "embeddings.md").write_text(text)
    plot(runs)


def plot(runs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 3.5))
    for offset, (engine, color) in enumerate(zip(ENGINES, ("tab:blue", "tab:gray"))):
        values = [statistics.median(r[f"batch {b}"] for r in runs[engine]) for b in BATCHES]
        axis.bar([i + 0.4 * offset for i in range(len(BATCHES))], values, 0.4, color=color, label=engine)
    axis.set_xticks([i + 0.2 for i in range(len(BATCHES))], [f"{b} per call" for b in BATCHES])
    axis.set_ylabel("sequences/s (median)")
    axis.set_title(f"embedding {NUM_TOKENS}-token inputs")
    axis.legend()
    figure.tight_layout()
    figure.savefig(RESULTS / "embeddings.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a GGUF file (default: the embedded model)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--measure", choices=ENGINES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure = measure_tokenriver if args.measure == "tokenriver" else measure_llamacpp
        print(json.dumps(measure(args.model, args.threads)))
        return
    from tokenriver.loader.load import default_model_path

    model = args.model or default_model_path()
    runs: dict[str, list[dict]] = {engine: [] for engine in ENGINES}
    for round_index in range(args.rounds):
        for engine in ENGINES if round_index % 2 == 0 else ENGINES[::-1]:
            runs[engine].append(run(engine, model, args.threads))
            print(engine, {k: v for k, v in runs[engine][-1].items() if k.startswith("batch")}, flush=True)
    write_results(runs, model, args.rounds, args.threads)


if __name__ == "__main__":
    main()
