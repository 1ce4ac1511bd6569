"""What the visualizer costs: one inspection against one forward pass of its context, and generation with the
visualizer's per-step bookkeeping against generation without it.

In one process, on the embedded model as `tokenriver serve` loads it, round after round, alternating:
(a) one inspection of the last position of a 256-token context (engine/inspection.py: every layer's logit lens,
    attention weights and update norms) against one plain prefill of the same context through the engine
    (LLM.generate, max_tokens 1, prefix cache off so that every round computes all 256 tokens). First as the
    server's visualizer asks for it, of a context the engine has run (its prefix cache holds the context's keys
    and values, and the inspection copies them and computes the position's row: AsyncEngine.inspect); then cold,
    of a context the engine never saw (all 256 tokens computed, in the engine's int8 KV format); the cold one with
    every layer on its module (modules_only: the definitions alone) against the prefill too; and the cold one
    against one forward pass of the context on the readable modules (the model's forward over a fresh cache, then
    the last row's logits: the path the inspection's definition is);
(b) generation where nothing is inspected, with the engine's defaults: one request decoding 128 greedy tokens after
    a short prompt (tokens/s from the engine's own timings), once as LLM() runs it (several greedy passes per step)
    and once with one pass per step as the server runs it, and a batch of 8 such requests of 64 tokens (generated
    tokens/s of the run). Each runs on an engine that keeps the pass log the visualizer reads
    (EngineCore._log_pass: the only work a step does for the visualizer alone; inspection runs only when asked)
    and on a second engine over the same weights whose _log_pass is stubbed out, in this process only.
Each figure is the median over the rounds and each ratio the median of the rounds' own ratios (each pair ran back
to back, so a drift of the machine's speed between rounds cancels out). Writes benchmarks/results/inspection.md and
inspection.png.

    python benchmarks/inspection.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common import RESULTS, machine_line, markdown_table, prompt_ids
from tokenriver import LLM, SamplingParams
from tokenriver.config import EngineConfig
from tokenriver.engine.async_engine import AsyncEngine
from tokenriver.engine.inspection import BLOCK_SIZE, ContextCache, inspect_position
from tokenriver.engine.llm import OFFLINE_SCHEDULER_STEPS
from tokenriver.loader.load import LoadedModel, default_model_path, load_model
from tokenriver.models.attention_metadata import AttentionMetadata
from tokenriver.models.fast_path import release_thread_pool

CONTEXT_TOKENS = 256
DECODE_TOKENS = 128
BATCH, BATCH_TOKENS = 8, 64
PROMPT = "Write a long story about a lighthouse."

LABELS = {
    "engine": "(a) the engine's inspection of the last position, its context run before / plain prefill",
    "inspection": "(a) cold inspection of the last position (nothing cached) / plain prefill of the context",
    "on modules": "(a) the cold inspection with every layer on its module (modules_only) / plain prefill",
    "module pass": "(a) cold inspection / one forward pass of the context on the readable modules",
    "decode": f"(b) decode, 1 request x {DECODE_TOKENS} tokens, LLM()'s {OFFLINE_SCHEDULER_STEPS} passes a step: "
    "pass log on / stubbed out",
    "decode, one pass a step": f"(b) decode, 1 request x {DECODE_TOKENS} tokens, one pass a step (the server's): "
    "pass log on / stubbed out",
    "batch": f"(b) batch, {BATCH} requests x {BATCH_TOKENS} tokens, LLM()'s defaults: pass log on / stubbed out",
}
NOTES = """(a), as the visualizer runs it: the engine's prefix cache holds the keys and values of the context's
whole blocks (240 of its 256 tokens), the inspection copies them out of the pool and runs the rest (16 rows) through
every layer, one call per layer so that the position's residual stream is read between layers. The cold rows
compute what a prefill of the context computes (every layer over all 256 tokens), on the same native kernels, in
the engine's int8 KV format, so the view is the engine's own arithmetic (the same bits either way: tests/engine/
test_inspection.py). On top of that come the taps: every layer's query and attention weights at the position, its
final-normed stream, and the output layer on all the layers' streams (the logit lens) where a prefill computes one
row of logits. The row with every layer on its module (modules_only) runs the cold inspection on the definitions
alone. The last row of (a) sets it against one forward pass of the context through the readable modules."""


def time_inspection(loaded: LoadedModel, ids: list[int], modules_only: bool = False) -> float:
    started = time.perf_counter()
    inspect_position(loaded, ids, len(ids) - 1, top_k=5, modules_only=modules_only, kv_dtype=torch.int8)
    return time.perf_counter() - started


def time_engine_inspection(engine: AsyncEngine, ids: list[int]) -> float:
    """The inspection as the visualizer asks for it, after the engine ran the context (a warm-up did). As in a
    server, one thread at a time keeps OpenMP workers: this one's go before the engine works, and the engine's
    before this thread works again (it lets them go after half a second idle: AsyncEngine._run)."""
    release_thread_pool()
    started = time.perf_counter()
    asyncio.run(engine.inspect(ids, len(ids) - 1, 5))
    elapsed = time.perf_counter() - started
    time.sleep(0.7)
    return elapsed


def run_context(engine: AsyncEngine, ids: list[int]) -> None:
    """The context through the engine once, so that its prefix cache holds the context's blocks."""

    async def run() -> None:
        async for _ in engine.generate(ids, SamplingParams(max_tokens=1, temperature=0.0)):
            pass

    asyncio.run(run())


@torch.inference_mode()
def time_module_pass(loaded: LoadedModel, ids: list[int]) -> float:
    """One forward pass of the context through the model's modules over a fresh cache, and the last row's logits."""
    started = time.perf_counter()
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    cache = ContextCache.allocate(loaded.model.config, num_blocks, torch.float32, torch.device("cpu"))
    metadata = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(num_blocks))], BLOCK_SIZE, "cpu")
    hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache, metadata)
    loaded.model.compute_logits(hidden[-1:])
    return time.perf_counter() - started


def time_prefill(llm: LLM, ids: list[int]) -> float:
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return time.perf_counter() - started


def decode_rate(llm: LLM, chat: str) -> float:
    """One request's decode tokens/s, from the engine's own timings (its prefill left out)."""
    greedy = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    (output,) = llm.generate([chat], greedy, use_tqdm=False)
    return 1 / output.metrics.time_per_output_token(len(output.outputs[0].token_ids))


def batch_rate(llm: LLM, chats: list[str]) -> float:
    """Generated tokens/s of a whole batch run, prefills included."""
    greedy = SamplingParams(max_tokens=BATCH_TOKENS, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(chats, greedy, use_tqdm=False)
    return len(chats) * BATCH_TOKENS / (time.perf_counter() - started)


def engines(loaded: LoadedModel, **options: object) -> tuple[LLM, LLM]:
    """(with the pass log, without it): two engines over the same weights; the second's step skips the log."""
    logged = LLM.from_loaded(loaded, **options)
    unlogged = LLM.from_loaded(loaded, **options)
    unlogged.engine._log_pass = lambda *args: None
    return logged, unlogged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    loaded = load_model(default_model_path(), int8_activations=None)
    prefill_llm = LLM.from_loaded(loaded, enable_prefix_caching=False)
    tokenizer = prefill_llm.get_tokenizer()
    ids = prompt_ids(tokenizer, CONTEXT_TOKENS)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": f"{PROMPT} Part {i}."}]) for i in range(BATCH)]
    offline = engines(loaded, num_scheduler_steps=OFFLINE_SCHEDULER_STEPS)
    per_pass = engines(loaded)
    serving = AsyncEngine(EngineConfig.from_flat(model=loaded.path), loaded)
    run_context(serving, ids)
    measures: dict[str, tuple[Callable[[], float], Callable[[], float]]] = {
        "engine": (lambda: time_engine_inspection(serving, ids), lambda: time_prefill(prefill_llm, ids)),
        "inspection": (lambda: time_inspection(loaded, ids), lambda: time_prefill(prefill_llm, ids)),
        "on modules": (lambda: time_inspection(loaded, ids, True), lambda: time_prefill(prefill_llm, ids)),
        "module pass": (lambda: time_inspection(loaded, ids), lambda: time_module_pass(loaded, ids)),
        "decode": (lambda: decode_rate(offline[0], chat), lambda: decode_rate(offline[1], chat)),
        "decode, one pass a step": (lambda: decode_rate(per_pass[0], chat), lambda: decode_rate(per_pass[1], chat)),
        "batch": (lambda: batch_rate(offline[0], chats), lambda: batch_rate(offline[1], chats)),
    }
    for first, second in measures.values():  # one warm-up each: first-call setup is not what is measured
        first(), second()
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in measures}
    for _ in range(args.rounds):
        for name, (first, second) in measures.items():
            runs[name].append((first(), second()))
        print({name: pairs[-1] for name, pairs in runs.items()}, file=sys.stderr)
    serving.shutdown()
    write_results(runs, args.rounds)
    return 0


def write_results(runs: dict[str, list[tuple[float, float]]], rounds: int) -> None:
    """The table and the plot, from each measure's (first, second) pairs, one per round."""
    ratios = {name: [a / b for a, b in pairs] for name, pairs in runs.items()}
    rows = []
    for name, label in LABELS.items():
        first, second = zip(*runs[name])
        if name in ("engine", "inspection", "on modules", "module pass"):
            figures = [f"{statistics.median(first) * 1000:.1f} ms", f"{statistics.median(second) * 1000:.1f} ms"]
        else:
            figures = [f"{statistics.median(first):.1f} tokens/s", f"{statistics.median(second):.1f} tokens/s"]
        rows.append([label, *figures, f"{statistics.median(ratios[name]):.2f}"])
    table = markdown_table(["measure", "first", "second", "ratio (median of rounds)"], rows)
    text = (
        "# Inspection vs one forward pass; generation with and without the visualizer's bookkeeping\n\n"
        f"`python benchmarks/inspection.py --rounds {rounds}`\n\n{machine_line()}\n\n"
        f"The embedded model as `tokenriver serve` loads it, {rounds} rounds after one warm-up each, the two sides of "
        "each row alternating. (a): a 256-token context. (b): nothing inspected; the second engine differs only in "
        f"its step skipping the pass log.\n\n![rounds](inspection.png)\n\n{table}\n\n{NOTES}\n"
    )
    (RESULTS / "inspection.md").write_text(text)
    plot(ratios, RESULTS / "inspection.png")
    print(text)


def plot(ratios: dict[str, list[float]], path: Path) -> None:
    """Each round's ratio per row, with its median and the line at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        "(a) engine's\ninspection /\nprefill",
        "(a) cold /\nprefill",
        "(a) on modules /\nprefill",
        "(a) inspection /\nmodule pass",
        "(b) decode,\nLLM()",
        "(b) decode,\none pass a step",
        "(b) batch of 8",
    ]
    figure, axis = plt.subplots(figsize=(8, 3.8))
    for position, values in enumerate(ratios.values()):
        axis.scatter([position] * len(values), values, color="#3b75af", alpha=0.6)
        axis.hlines(statistics.median(values), position - 0.2, position + 0.2, color="black")
    axis.axhline(1.0, color="#c0392b", linestyle="--", linewidth=1)
    axis.set_xticks(range(len(ratios)), labels)
    axis.set_ylabel("ratio (first / second)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
