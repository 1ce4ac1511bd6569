"""How much of the machine's memory bandwidth each engine's decode uses, per GGUF file.

A single-stream decode step reads every weight matrix once (and the whole output layer), so its speed is bounded by
bytes per token / read bandwidth. Measured here, in fresh processes, engines alternating per round:
- the machine's read bandwidth: a STREAM-style reduction over a 1 GiB float32 array with the benchmark's threads
  (best of five), the ceiling any decode can reach, measured in each decode's process right after its decode (the
  machine's bandwidth moves by tens of percent between runs, so each run is set against its own);
- bytes per decode token for each engine: tokenriver's in-memory weights (every tensor of the model, less the
  token-embedding table unless the output layer is that table) and llama.cpp's (the file's tensors, less
  token_embd unless there is no output.weight); one embedding row per token is left out on both sides;
- single-stream greedy decode tokens/s after a chat prompt (128 tokens, EOS ignored), each engine's defaults;
- bytes per token x tokens/s: the bandwidth each engine reaches, and its share of the ceiling measured with it
  (the median of the runs' shares).

    python benchmarks/bandwidth.py [--models embedded,Q4_K_M,large,qwen,qwen1.5b,gemma3] [--rounds 3] [--threads 2]

Needs the `bench` extra (llama-cpp-python). Writes benchmarks/results/bandwidth.md.
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

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))

from common import RESULTS, machine_line, markdown_table  # noqa: E402
from model_files import DEFAULT_DIR, embedded_model_path, large_file, qwen_1_5b_file, qwen_file, smollm_file  # noqa: E402

ENGINES = ("tokenriver", "llama.cpp")
MAX_TOKENS = 128
PROMPT = "Write a short story about a river that carries words to the sea."


def read_bandwidth(threads: int) -> float:
    """GB/s of a reduction over 1 GiB of float32: the read rate of memory, not of a cache."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(2**28, dtype=torch.float32)  # [256 Mi] float32, 1 GiB
    data.sum()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * data.element_size() / best / 1e9


def tokenriver_bytes(model) -> int:
    """Bytes one decode step reads: every tensor but the token-embedding table, which only the output layer reads
    whole (when it is that table)."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()] if t.numel()}
    table = {
        t.data_ptr()
        for name, module in model.named_modules()
        if name.endswith("embed_tokens")
        for t in [*module.parameters(), *module.buffers()]
    }
    head = getattr(model, "lm_head", None)
    read_by_head = {t.data_ptr() for t in [*head.parameters(), *head.buffers()]} if head is not None else set()
    skipped = table - read_by_head
    return sum(t.numel() * t.element_size() for ptr, t in tensors.items() if ptr not in skipped)


def llamacpp_bytes(path: str) -> int:
    """The file's tensor bytes less token_embd, unless the output layer is token_embd (no output.weight)."""
    import gguf

    reader = gguf.GGUFReader(path)
    sizes = {tensor.name: int(tensor.n_bytes) for tensor in reader.tensors}
    embedding = sizes["token_embd.weight"] if "output.weight" in sizes else 0
    return sum(sizes.values()) - embedding


def worker(engine: str, path: str, threads: int) -> dict:
    """Decode tokens/s and bytes per token of one engine on one file (in its own process)."""
    if engine == "tokenriver":
        from tokenriver import LLM, SamplingParams

        llm = LLM(path, num_threads=threads)
        ids = llm.get_tokenizer().encode(llm.get_tokenizer().apply_chat_template([{"role": "user", "content": PROMPT}]))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        (output,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        decode = 1 / output.metrics.time_per_output_token(len(output.outputs[0].token_ids))
        num_bytes = tokenriver_bytes(llm.engine.loaded.model)
        return {"decode": decode, "bytes": num_bytes, "bandwidth": read_bandwidth(threads)}
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
    ids = llm.tokenize(PROMPT.encode())
    times = []
    for _ in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        times.append(time.perf_counter())
        if len(times) == MAX_TOKENS:
            break
    decode = (len(times) - 1) / (times[-1] - times[0])
    return {"decode": decode, "bytes": llamacpp_bytes(path), "bandwidth": read_bandwidth(threads)}


def run(args: list[str], threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, __file__, "--worker", *args, "--threads", str(threads)]
    output = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def files_for(names: list[str], models_dir: Path) -> dict[str, str]:
    makers = {
        "embedded": embedded_model_path,
        "large": lambda: large_file(models_dir),
        "large-Q3_K_M": lambda: large_file(models_dir, "Q3_K_M"),
        "large-Q2_K": lambda: large_file(models_dir, "Q2_K"),
        "qwen": lambda: qwen_file(models_dir),
        "qwen1.5b": lambda: qwen_1_5b_file(models_dir),
    }
    files = {}
    for name in names:
        if name == "gemma3":
            from real_models import gemma3_file

            path = gemma3_file()
            if path is not None:
                files[name] = path
        else:
            files[name] = str(makers[name]() if name in makers else smollm_file(name, models_dir))
    return files


def report(files: dict[str, str], runs: dict, threads: int, rounds: int) -> None:
    bandwidths = [
        r["bandwidth"] for by_engine in runs.values() for engine_runs in by_engine.values() for r in engine_runs
    ]
    rows = []
    for name, path in files.items():
        row: list[object] = [Path(path).name]
        cells = {}
        for engine in ENGINES:
            decode = statistics.median(r["decode"] for r in runs[name][engine])
            num_bytes = runs[name][engine][0]["bytes"]
            share = statistics.median(r["decode"] * num_bytes / 1e9 / r["bandwidth"] for r in runs[name][engine])
            cells[engine] = (decode, num_bytes, decode * num_bytes / 1e9, share)
        for engine in ENGINES:
            row.append(f"{cells[engine][1] / 2**20:,.0f}")
        for engine in ENGINES:
            decode, _, rate, share = cells[engine]
            row.append(f"{decode:,.1f} ({rate:,.1f} GB/s, {share:.0%})")
        row.append(f"{cells['tokenriver'][0] / cells['llama.cpp'][0]:.2f}x")
        rows.append(row)
    table = markdown_table(
        [
            "file",
            "MiB/token, tokenriver",
            "MiB/token, llama.cpp",
            "decode tok/s, tokenriver (bandwidth, share)",
            "decode tok/s, llama.cpp (bandwidth, share)",
            "ratio",
        ],
        rows,
    )
    text = (
        "# Decode against the memory bandwidth\n\n"
        f"{machine_line()}\n\n"
        f"Read bandwidth (a reduction over 1 GiB of float32, {threads} threads, measured in every run's process "
        f"after its decode): median {statistics.median(bandwidths):.1f} GB/s, {min(bandwidths):.1f} to "
        f"{max(bandwidths):.1f}. Single-stream greedy decode of {MAX_TOKENS} tokens, each engine's defaults, "
        f"{threads} threads, {rounds} rounds alternating, medians; the share is bytes per token x tokens/s over the "
        f"bandwidth measured in the same process, the median of the runs'. `python benchmarks/bandwidth.py`."
        f"\n\n{table}\n"
    )
    (RESULTS / "bandwidth.md").write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="embedded,Q4_K_M,large,large-Q3_K_M,large-Q2_K,qwen,qwen1.5b,gemma3")
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.threads)))
        return
    files = files_for(args.models.split(","), args.models_dir)
    runs = {name: {engine: [] for engine in ENGINES} for name in files}
    for round_index in range(args.rounds):
        for name, path in files.items():
            for engine in ENGINES if round_index % 2 == 0 else ENGINES[::-1]:
                runs[name][engine].append(run([engine, path], args.threads))
                print(name, engine, runs[name][engine][-1], flush=True)
    report(files, runs, args.threads, args.rounds)
    print(f"wrote {RESULTS / 'bandwidth.md'}")


if __name__ == "__main__":
    main()
