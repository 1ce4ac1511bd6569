"""Speculative decoding: decode tokens/s with and without it, same run, on two kinds of task.

- input-grounded: the answer repeats much of the prompt (copy or lightly edit a given text or code), where
  n-gram drafts (prompt lookup) hit;
- open chat: the answer is new text, where they rarely do.

One request at a time (single stream), greedy, so every configuration must produce exactly the tokens of plain
decoding (checked). Configurations alternate prompt by prompt to cancel machine drift. Decode speed is generated
tokens over the time from first to last token (prefill excluded), summed over the prompts of a task. Writes
benchmarks/results/speculative.md.

    python benchmarks/speculative.py [--quantization auto|none] [--repeats 2] [--threads 2] [--max-tokens 160]

--quantization is the target's weights: auto keeps the GGUF's Q4_1 packed (decode is compute-bound in the 4-bit
kernel, so verifying k drafts costs more than one token), none runs it in float32 (memory-bound: verifying k drafts
costs about one token). The `q4` configuration drafts with the same GGUF file kept packed: a 4-bit copy of the
target.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import RESULTS, machine_line, markdown_table
from tokenriver import LLM, SamplingParams
from tokenriver.loader.load import load_model

CODE = """def load_config(path):
    with open(path) as handle:
        lines = handle.read().splitlines()
    config = {}
    for line in lines:
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config


def save_config(path, config):
    with open(path, "w") as handle:
        for key, value in sorted(config.items()):
            handle.write(f"{key} = {value}\\n")
"""
TEXT = (
    "The river rises in the mountains, where snow melts every spring and feeds a thousand small streams. "
    "It runs through three countries and past eleven cities before it reaches the sea. For centuries its "
    "water turned mills, carried boats loaded with grain and timber, and gave the valley its name. Today it "
    "is quieter: the mills are museums, the boats carry tourists, and the fish have come back."
)
GROUNDED = [
    f"Repeat the following code exactly, without any change:\n\n{CODE}",
    f"Copy this paragraph word for word:\n\n{TEXT}",
    f"Add a docstring to each function and otherwise return the code unchanged:\n\n{CODE}",
    f"Rewrite this paragraph, replacing 'river' with 'stream' and changing nothing else:\n\n{TEXT}",
]
OPEN_CHAT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in simple words why the sky is blue and sunsets are red.",
    "Give me five tips for learning a new programming language.",
    "What are the pros and cons of living in a big city?",
]
WEIGHTS = {"auto": "the file's Q4_1 kept packed (4-bit kernels)", "none": "dequantized to float32"}
RESULT_FILES = {"auto": "speculative.md", "none": "speculative_float32.md"}
TASKS = {"input-grounded (copy / edit a given text or code)": GROUNDED, "open chat": OPEN_CHAT}


def run(llm: LLM, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], float, int, int]:
    """(tokens, decode seconds, draft tokens, accepted draft tokens) of one greedy request."""
    (output,) = llm.generate(
        [{"prompt_token_ids": prompt_ids}], SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False
    )
    metrics = output.metrics
    decode_time = metrics.last_token_time - metrics.first_token_time
    return (output.outputs[0].token_ids, decode_time, metrics.num_draft_tokens, metrics.num_accepted_draft_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none"],
        help="the target's weights: auto = the GGUF's Q4_1 kept packed, none = float32",
    )
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument(
        "--configs",
        default="none,ngram:4,ngram:8,self:8:3",
        help="comma-separated: none, ngram:K, self:N:K, q4:K (the GGUF file itself, packed)",
    )
    parser.add_argument("--note", default="", help="a line about the machine, written into the results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model(None, quantization=args.quantization)
    tokenizer = loaded.tokenizer
    engines: dict[str, LLM] = {}
    for name in args.configs.split(","):
        options: dict[str, object] = {}
        if name.startswith("ngram:"):
            options = {"speculative_draft": "ngram", "num_speculative_tokens": int(name.split(":")[1])}
        elif name.startswith("self:"):
            _, layers, k = name.split(":")
            options = {"speculative_draft": f"self:{layers}", "num_speculative_tokens": int(k)}
        elif name.startswith("q4:"):
            options = {"speculative_draft": loaded.path, "num_speculative_tokens": int(name.split(":")[1])}
        engines[name] = LLM.from_loaded(
            loaded, num_threads=args.threads, max_num_kv_tokens=8192, quantization=args.quantization, **options
        )
    prompts = {
        task: [
            tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
            for p in texts
        ]
        for task, texts in TASKS.items()
    }
    for llm in engines.values():
        run(llm, prompts["open chat"][0], 8)

    rows = []
    all_identical = True
    started = time.perf_counter()
    for task, task_prompts in prompts.items():
        # config → per-repeat decode tokens/s; plus draft counts and the plain tokens to compare with.
        speeds: dict[str, list[float]] = {name: [] for name in engines}
        drafts = dict.fromkeys(engines, 0)
        accepted = dict.fromkeys(engines, 0)
        identical = dict.fromkeys(engines, True)
        num_tokens = 0
        for repeat in range(args.repeats):
            totals = {name: [0, 0.0] for name in engines}
            for ids in task_prompts:
                reference = None
                for name, llm in engines.items():
                    tokens, seconds, num_drafts, num_accepted = run(llm, ids, args.max_tokens)
                    reference = tokens if reference is None else reference
                    identical[name] &= tokens == reference
                    totals[name][0] += len(tokens) - 1
                    totals[name][1] += seconds
                    if repeat == 0:
                        drafts[name] += num_drafts
                        accepted[name] += num_accepted
                num_tokens += len(reference) if repeat == 0 else 0
            for name, (count, seconds) in totals.items():
                speeds[name].append(count / seconds)
        baseline = statistics.median(speeds["none"])
        for name in engines:
            speed = statistics.median(speeds[name])
            rate = f"{accepted[name] / drafts[name]:.0%}" if drafts[name] else "-"
            rows.append(
                [
                    task,
                    name,
                    f"{speed:.1f}",
                    f"{speed / baseline:.2f}x",
                    drafts[name],
                    accepted[name],
                    rate,
                    "yes" if identical[name] else "NO",
                ]
            )
            all_identical &= identical[name]
        print(f"{task}: {num_tokens} tokens per configuration and repeat", flush=True)
    elapsed = time.perf_counter() - started

    report = [
        "# Speculative decoding: decode speed with and without drafts",
        "",
        f"Embedded SmolLM2-135M-Instruct (Q4_1 GGUF), target weights: {WEIGHTS[args.quantization]}, float32 "
        "compute, one request at a time, greedy, "
        f"max {args.max_tokens} tokens, {len(GROUNDED)} prompts per task, median of {args.repeats} repeats "
        f"(configurations alternate prompt by prompt). Machine: {machine_line()}.",
    ]
    if args.note:
        report.append(f"Note: {args.note}")
    report += [
        f"Command: `python benchmarks/speculative.py --quantization {args.quantization} --repeats {args.repeats} "
        f"--threads {args.threads} "
        f"--max-tokens {args.max_tokens} --configs {args.configs}` ({elapsed / 60:.0f} min).",
        "",
        "Configurations: `none` = plain decoding; `ngram:K` = prompt-lookup drafts (suffix n-grams of 2..4 tokens "
        "looked up in the request's own tokens), up to K per step; `self:N:K` = the model's first N of 30 layers "
        "as a draft model, K drafts per step; `q4:K` = the GGUF file itself as the draft model, its Q4_1 weights "
        "kept packed (a 4-bit copy of the target), K drafts per step. Decode tokens/s = generated tokens / "
        "(last token time - first token time), summed over the task's prompts. Acceptance = accepted / proposed "
        "draft tokens (first repeat). "
        "`same tokens` = greedy output identical to plain decoding for every prompt.",
        "",
        markdown_table(
            ["task", "config", "decode tokens/s", "speedup", "draft tokens", "accepted", "acceptance", "same tokens"],
            rows,
        ),
        "",
    ]
    if not all_identical:
        report.append("**Warning: some configuration changed the greedy output.**")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / RESULT_FILES[args.quantization]).write_text("\n".join(report))
    print("\n".join(report))


if __name__ == "__main__":
    main()
