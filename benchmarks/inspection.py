"""What the visualizer's "inside the forward pass" costs: one inspection against one plain prefill.

In one process, on the embedded model as `tokenriver serve` loads it, alternating the two each round: (a) one
inspection of the last position of a 256-token context (engine/inspection.py: the readable modules, a KV cache of
its own, the logit lens at every layer, attention weights recomputed per layer), and (b) one prefill of the same
context through the engine (LLM.generate, max_tokens 1, prefix cache off so every round computes all 256 tokens).
Prints a markdown table and writes benchmarks/results/inspection.md.

    python benchmarks/inspection.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import RESULTS, machine_line, markdown_table, prompt_ids
from tokenriver import LLM, SamplingParams
from tokenriver.engine.inspection import inspect_position
from tokenriver.loader.load import default_model_path, load_model

CONTEXT_TOKENS = 256


def time_inspection(loaded, ids: list[int]) -> float:
    started = time.perf_counter()
    inspect_position(loaded, ids, len(ids) - 1, top_k=5)
    return time.perf_counter() - started


def time_prefill(llm: LLM, ids: list[int]) -> float:
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    loaded = load_model(default_model_path(), int8_activations=None)
    llm = LLM.from_loaded(loaded, enable_prefix_caching=False)
    ids = prompt_ids(llm.get_tokenizer(), CONTEXT_TOKENS)
    # One warm-up each: first-call setup is not what is measured.
    time_inspection(loaded, ids)
    time_prefill(llm, ids)
    inspections, prefills = [], []
    for _ in range(args.rounds):
        inspections.append(time_inspection(loaded, ids))
        prefills.append(time_prefill(llm, ids))
    inspection, prefill = statistics.median(inspections), statistics.median(prefills)
    rows = [
        ["(a) inspection of the last position", f"{inspection * 1000:.1f}", _range(inspections)],
        ["(b) plain prefill through the engine", f"{prefill * 1000:.1f}", _range(prefills)],
        ["ratio (a) / (b)", f"{inspection / prefill:.2f}", ""],
    ]
    table = markdown_table(["measure", "median (ms)", "range (ms)"], rows)
    text = (
        "# Inspection vs prefill\n\n"
        f"{machine_line()}\n\n"
        f"A {CONTEXT_TOKENS}-token context on the embedded model as `tokenriver serve` loads it, {args.rounds} rounds, "
        "(a) and (b) alternating after one warm-up each. `python benchmarks/inspection.py`.\n\n"
        f"{table}\n"
    )
    print(text)
    (RESULTS / "inspection.md").write_text(text)


def _range(seconds: list[float]) -> str:
    return f"{min(seconds) * 1000:.1f}-{max(seconds) * 1000:.1f}"


if __name__ == "__main__":
    main()
