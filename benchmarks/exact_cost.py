"""What exactness costs: the engine's defaults against a baseline checkout's defaults, same machine, same run.

"Exact by default" (one arithmetic per row in every product, one attention code path) must not slow the defaults
down. Each measurement runs in a fresh process on one of the two source trees, the trees alternating round after
round so that machine drift hits both alike:
- decode: one request, 128 greedy tokens after a short chat prompt, tokens/s from the engine's own timings;
- prefill: a 512-token prompt, one token out, prompt tokens/s;
- 32 x 128: 32 chat prompts at once, 128 greedy tokens each, generated tokens/s of the whole run.
On the embedded model and on SmolLM2 in Q4_K_M as llama.cpp's quantizer writes it (benchmarks/model_files.py).

    git worktree add /tmp/baseline <commit before the change>
    python benchmarks/exact_cost.py --baseline /tmp/baseline [--rounds 5]

Writes benchmarks/results/exact_cost.md and exact_cost.png.
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

from common import RESULTS, machine_line, markdown_table

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("decode", "prefill", "batch")
LABELS = {"decode": "decode (tokens/s)", "prefill": "prefill 512 (tokens/s)", "batch": "32 x 128 (tokens/s)"}


def measure(model: str | None, threads: int) -> dict[str, float]:
    """The three numbers for one model in this process (best of three where cheap)."""
    from common import prompt_ids
    from tokenriver import LLM, SamplingParams

    llm = LLM(model=model, num_threads=threads)
    tokenizer = llm.get_tokenizer()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Write a long story about a lighthouse."}])
    greedy = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    llm.generate([chat], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    decode, prefill = 0.0, 0.0
    for _ in range(3):
        llm.reset_prefix_cache()
        (output,) = llm.generate([chat], greedy, use_tqdm=False)
        per_token = output.metrics.time_per_output_token(len(output.outputs[0].token_ids))
        decode = max(decode, 1 / per_token)
        llm.reset_prefix_cache()
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt_ids(tokenizer, 512)}], SamplingParams(max_tokens=1), use_tqdm=False)
        prefill = max(prefill, 512 / (time.perf_counter() - started))
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me about topic number {i}."}])
        for i in range(32)
    ]
    llm.reset_prefix_cache()
    started = time.perf_counter()
    llm.generate(prompts, greedy, use_tqdm=False)
    return {"decode": decode, "prefill": prefill, "batch": 32 * 128 / (time.perf_counter() - started)}


def run_in(tree: Path, model: str | None, threads: int) -> dict[str, float]:
    """measure() in a fresh process importing tokenriver from tree/src."""
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{Path(__file__).parent}"}
    command = [sys.executable, __file__, "--measure", "--threads", str(threads)]
    if model is not None:
        command += ["--model", model]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def write_results(runs: dict, rounds: int, baseline: str) -> None:
    rows = []
    for model, trees in runs.items():
        for metric in METRICS:
            current = [r[metric] for r in trees["current"]]
            base = [r[metric] for r in trees["baseline"]]
            ratio = statistics.median(current) / statistics.median(base)
            rows.append(
                [
                    model,
                    LABELS[metric],
                    f"{statistics.median(base):,.0f} ({min(base):,.0f}-{max(base):,.0f})",
                    f"{statistics.median(current):,.0f} ({min(current):,.0f}-{max(current):,.0f})",
                    f"{ratio:.3f}",
                ]
            )
    table = markdown_table(["model", "measure", "baseline: median (range)", "exact: median (range)", "ratio"], rows)
    text = (
        "# What exactness costs\n\n"
        f"{machine_line()}\n\n"
        f"The engine's defaults against the baseline checkout's ({baseline}), {rounds} rounds, each measure in a "
        "fresh process, the two trees alternating. `python benchmarks/exact_cost.py --baseline <checkout>`.\n\n"
        f"{table}\n"
    )
    (RESULTS / "exact_cost.md").write_text(text)
    plot(runs)


def plot(runs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.5), squeeze=False)
    for axis, (model, trees) in zip(axes[0], runs.items()):
        for offset, (tree, color) in enumerate((("baseline", "tab:gray"), ("current", "tab:blue"))):
            ratios = [
                statistics.median(r[m] for r in trees[tree]) / statistics.median(r[m] for r in trees["baseline"])
                for m in METRICS
            ]
            axis.bar([i + 0.4 * offset for i in range(len(METRICS))], ratios, 0.4, color=color, label=tree)
        axis.set_xticks([i + 0.2 for i in range(len(METRICS))], [LABELS[m].split(" (")[0] for m in METRICS])
        axis.set_ylim(0.8, 1.2)
        axis.axhline(0.97, color="tab:red", linestyle=":", linewidth=1)
        axis.set_title(model)
        axis.set_ylabel("speed / baseline's (median)")
        axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(RESULTS / "exact_cost.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="a checkout of the commit to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.model, args.threads)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    import model_files

    models = {"embedded (Q4_1)": None, "SmolLM2 Q4_K_M": str(model_files.smollm_file("Q4_K_M"))}
    runs = {name: {"baseline": [], "current": []} for name in models}
    trees = {"baseline": args.baseline, "current": ROOT}
    for round_index in range(args.rounds):
        order = ("baseline", "current") if round_index % 2 == 0 else ("current", "baseline")
        for name, model in models.items():
            for tree in order:
                runs[name][tree].append(run_in(trees[tree], model, args.threads))
                print(name, tree, runs[name][tree][-1], flush=True)
    write_results(
        runs,
        args.rounds,
        subprocess.check_output(["git", "-C", args.baseline, "log", "-1", "--format=%h"], text=True).strip(),
    )


if __name__ == "__main__":
    main()
