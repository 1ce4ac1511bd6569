"""Where a batched generate's time goes on a GPU: each engine step's wall time, and the run's heaviest kernels.

    python benchmarks/gpu_profile.py            # the Llama-3.2-1B shape, 64 prompts x 128 tokens, defaults
    python benchmarks/gpu_profile.py --prompts 256 --tokens 128

benchmarks/gpu.py says how fast tokenriver is against transformers; this says why. For one `LLM.generate` of the
batch (random-weight model, random prompts, greedy, every request producing all its tokens), after a warm-up that
records the CUDA graphs, it prints:
- the run's tokens/s (median of 3) and the single-stream decode rate beside it;
- the first step (the prompts' prefill) and the later steps (multi-step decode passes) in wall time: a slow first
  step points at the prompt path, a step far above its kernels' time at the host;
- from the profiler, the GPU's kernel time per decode pass and the heaviest kernels, then the host's heaviest calls
  (time inside cudaGraphLaunch or a device-to-host copy is the host waiting for the GPU);
- from Python's own profiler, the engine's heaviest Python functions in one generate: what the host spends its
  time on between the GPU's work.

It runs a second configuration for comparison (`--compare`, default `num_scheduler_steps=32`), so a change of
the engine's knobs is measured in the same process.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # noqa: E402  (the model builder and shapes of the GPU benchmark)


def instrument(llm) -> list[tuple[float, int]]:
    """(wall seconds, forward passes) of every engine step from now on."""
    core = llm.engine
    step = core.step
    log: list[tuple[float, int]] = []

    def timed_step():
        started, passes = time.perf_counter(), core.runner.num_forward_passes
        outputs = step()
        log.append((time.perf_counter() - started, core.runner.num_forward_passes - passes))
        return outputs

    core.step = timed_step
    return log


def generate(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from tokenriver import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return gpu.timed(
        "cuda", lambda: llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    )


def profile(llm, prompts: list[list[int]], max_tokens: int, top: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        generate(llm, prompts, max_tokens)
    events = profiler.key_averages()
    kernels = sorted(
        ((e.key, e.self_device_time_total, e.count) for e in events if e.self_device_time_total > 0),
        key=lambda kernel: -kernel[1],
    )
    total = sum(us for _, us, _ in kernels)
    print(f"  GPU kernel time {total / 1e3:.1f} ms in the run, {total / 1e3 / max_tokens:.3f} ms per pass")
    for name, us, count in kernels[:top]:
        print(f"    {us / 1e3:8.2f} ms {count:7d}x  {name[:110]}")
    print("  host, self time:")
    for name, us, count in sorted(((e.key, e.self_cpu_time_total, e.count) for e in events), key=lambda call: -call[1])[
        :top
    ]:
        print(f"    {us / 1e3:8.2f} ms {count:7d}x  {name[:110]}")
    python_profile(llm, prompts, max_tokens, top)


def python_profile(llm, prompts: list[list[int]], max_tokens: int, top: int) -> None:
    """The heaviest Python functions of one generate, by their own time and by time with their callees (the
    profiler's overhead inflates both, evenly enough to rank them)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    generate(llm, prompts, max_tokens)
    profiler.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(top)
        print(f"  Python, by {order}:")
        print("\n".join("    " + line for line in text.getvalue().splitlines() if line.strip()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64, help="prompts in the batch (default 64)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each one generates (default 128)")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt (default 32)")
    parser.add_argument(
        "--compare",
        default="num_scheduler_steps=32",
        help="a second configuration, NAME=INT engine options joined by commas ('' for none)",
    )
    parser.add_argument("--top", type=int, default=25, help="kernels and host calls listed (default 25)")
    args = parser.parse_args()
    compare: dict[str, int] = {}
    for item in filter(None, args.compare.split(",")):
        name, _, value = item.partition("=")
        if not name or not value.lstrip("-").isdigit():
            parser.error(f"--compare: {item!r} is not NAME=INT (e.g. num_scheduler_steps=32)")
        compare[name] = int(value)
    if args.prompts < 1 or args.tokens < 2 or args.prompt_len < 1:
        parser.error("--prompts and --prompt-len must be at least 1, --tokens at least 2")
    configurations = [("default", {})] + ([(args.compare, compare)] if compare else [])
    if not torch.cuda.is_available():
        parser.error(f"this torch ({torch.__version__}) sees no CUDA GPU")

    from tokenriver import LLM

    print(gpu.device_line("cuda"), flush=True)
    rng = random.Random(0)
    vocab = int(gpu.LLAMA_1B_SHAPE["vocab_size"])
    prompts = [
        [rng.randrange(gpu.ID_MARGIN, vocab - gpu.ID_MARGIN) for _ in range(args.prompt_len)]
        for _ in range(args.prompts)
    ]
    with tempfile.TemporaryDirectory(prefix="tokenriver-gpu-profile-") as folder:
        gpu.write_random_model(Path(folder), gpu.LLAMA_1B_SHAPE, "cuda")
        for label, options in configurations:
            llm = LLM(
                folder,
                dtype="bfloat16",
                device="cuda",
                enable_prefix_caching=False,
                max_num_seqs=max(256, args.prompts),
                max_model_len=gpu.MAX_MODEL_LEN,
                **options,
            )
            log = instrument(llm)
            generate(llm, prompts[:1], args.tokens)
            generate(llm, prompts, args.tokens)  # records the graphs of every block bucket the run reaches
            totals = []
            for _ in range(3):
                log.clear()
                totals.append(generate(llm, prompts, args.tokens))
            steps = list(log)
            single = generate(llm, prompts[:1], args.tokens) - min(generate(llm, prompts[:1], 1) for _ in range(3))
            print(
                f"== {label}: {args.prompts} x {args.tokens} in {[round(t, 4) for t in totals]} s: "
                f"{args.prompts * args.tokens / statistics.median(totals):,.0f} tokens/s; single-stream decode "
                f"{(args.tokens - 1) / single:,.0f} tokens/s",
                flush=True,
            )
            rest = steps[1:]
            print(
                f"  steps: {len(steps)}; the first {steps[0][0] * 1e3:.2f} ms ({steps[0][1]} pass); the others "
                f"{sum(s for s, _ in rest) * 1e3:.1f} ms over {sum(p for _, p in rest)} passes, e.g. "
                f"{[(round(s * 1e3, 2), p) for s, p in rest[:4]]} (ms, passes)",
                flush=True,
            )
            if label == "default":
                profile(llm, prompts, args.tokens, args.top)
            del llm
            gpu.free_memory("cuda")
    return 0


if __name__ == "__main__":
    sys.exit(main())
