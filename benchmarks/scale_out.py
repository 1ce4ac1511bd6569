"""Scale-out benchmark: replicas on Ray Serve, prefix-aware vs round-robin routing, tensor parallelism.

    python benchmarks/scale_out.py                 # all three parts
    python benchmarks/scale_out.py --parts tp      # one part: tp, replicas, routing

- tp: decode step time of the embedded model in one process and split over 2 gloo ranks (processes), with the time
  rank 0 spends inside the row-parallel gathers measured separately (it includes waiting for the slower rank).
- replicas: the same batch of concurrent completions against 1 and 2 engine replicas (one CPU, one thread each).
- routing: 8 system prompts x many users, a few users at a time, against 2 replicas routed by longest cached
  prefix or round robin: TTFT (request sent → first streamed token) and the prefix-cache hit rate from /metrics.
Writes benchmarks/results/scale_out.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402

from common import RESULTS, machine_line, markdown_table  # noqa: E402
from tokenriver.config import EngineConfig  # noqa: E402
from tokenriver.engine.llm import LLM  # noqa: E402
from tokenriver.params import SamplingParams  # noqa: E402
from tokenriver.server.config import ServerConfig  # noqa: E402


def load_average() -> str:
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "n/a"


# ----- tensor parallel ------------------------------------------------------------------------------------------
def decode_steps(tensor_parallel_size: int, num_threads: int, num_prompts: int, num_tokens: int) -> dict[str, float]:
    llm = LLM(tensor_parallel_size=tensor_parallel_size, num_threads=num_threads, max_num_kv_tokens=4096)
    engine = llm.engine
    prompts = [f"Request {i}: write a long story about the river and its stones." for i in range(num_prompts)]
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(
                str(i),
                engine.tokenizer.encode(prompt),
                SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True),
            )
        engine.step()  # the prompts' prefill
        times = getattr(getattr(engine.runner, "group", None), "times", None)
        reduce_before = times.gather_seconds if times else 0.0
        count_before = times.num_gathers if times else 0
        durations = []
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            durations.append(time.perf_counter() - started)
        steps = len(durations)
        return {
            "step_ms": 1000 * statistics.median(durations),
            "mean_ms": 1000 * sum(durations) / steps,
            "reduce_ms": 1000 * (times.gather_seconds - reduce_before) / steps if times else 0.0,
            "reduces": (times.num_gathers - count_before) / steps if times else 0.0,
            "steps": steps,
        }
    finally:
        engine.close()


def run_tp(args: argparse.Namespace) -> str:
    rows = []
    for size, threads in ((1, 1), (1, 2), (2, 2)):
        result = decode_steps(size, threads, args.tp_batch, args.tp_tokens)
        rows.append(
            [
                size,
                f"{threads // size} per rank",
                args.tp_batch,
                result["steps"],
                result["step_ms"],
                result["mean_ms"],
                result["reduces"],
                result["reduce_ms"],
            ]
        )
    return (
        "## Tensor parallel: decode step time\n\n"
        f"{args.tp_batch} greedy requests decoding {args.tp_tokens} tokens each; one engine step = one forward "
        "pass for all of them. TP=1: one process, 1 or 2 threads (the native one-call decoder). TP=2: two gloo "
        "ranks on this machine, 1 thread each, the module path (sharded layers are not native-runnable). "
        "Gather time is rank 0's wall time inside the row-parallel projections' `all_gather`, waiting for rank 1 "
        "included.\n\n"
        + markdown_table(
            [
                "TP",
                "threads",
                "requests",
                "decode steps",
                "step p50 ms",
                "step mean ms",
                "gathers / step",
                "gather ms / step",
            ],
            rows,
        )
    )


# ----- Ray Serve ------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deploy(num_replicas: int, router: str) -> None:
    from ray import serve

    from tokenriver.serve_ray.app import build_application

    serve.delete("tokenriver")
    serve.run(
        build_application(
            EngineConfig.from_flat(max_num_kv_tokens=8192, num_threads=1), ServerConfig(), num_replicas, router
        ),
        name="tokenriver",
        route_prefix="/",
    )
    time.sleep(2)  # first routing stats and board posts


async def completions(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[float, list[float]]:
    """(wall seconds, TTFT of each request) for streamed completions, `concurrency` at a time."""
    ttfts: list[float] = []
    queue = list(prompts)

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            prompt = queue.pop(0)
            sent = time.perf_counter()
            first = None
            async with http.stream(
                "POST",
                "/v1/completions",
                json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True},
            ) as response:
                assert response.status_code == 200, response.status_code
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - sent
            ttfts.append(first)

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return time.perf_counter() - started, ttfts


def metric(url: str, name: str) -> float:
    time.sleep(2.5)  # replicas post their metrics every second
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def run_replicas(args: argparse.Namespace, url: str) -> str:
    rows = []
    prompts = [f"Request {i}: tell me about rivers." for i in range(args.replica_requests)]
    for replicas in (1, 2):
        deploy(replicas, "round_robin")
        wall, ttfts = asyncio.run(completions(url, prompts, args.replica_tokens, args.replica_concurrency))
        tokens = len(prompts) * args.replica_tokens
        rows.append(
            [replicas, len(prompts), args.replica_concurrency, wall, tokens / wall, 1000 * statistics.median(ttfts)]
        )
    return (
        "## Replicas: 1 vs 2 (Ray Serve, one CPU and one thread per replica)\n\n"
        f"{args.replica_requests} streamed completions of exactly {args.replica_tokens} tokens, "
        f"{args.replica_concurrency} in flight, round-robin routing. The machine has 2 cores, shared with "
        "the ingress, Ray's own processes and other work: two replicas can at best double one.\n\n"
        + markdown_table(["replicas", "requests", "in flight", "wall s", "output tok/s", "TTFT p50 ms"], rows)
    )


def run_routing(args: argparse.Namespace, url: str) -> str:
    systems = [
        f"System prompt {k}: you are the assistant of team {k} at a parcel company. "
        + "Answer briefly, cite the policy, never guess a tracking number. " * 4
        for k in range(8)
    ]
    prompts = [
        systems[user % 8] + f"User {user}: my parcel {1000 + user} has not arrived, what now?"
        for user in range(args.routing_users)
    ]
    # Users arrive in a random (seeded) order: in strict rotation, round robin over an even number of replicas
    # would send each system prompt to the same replica every time by accident.
    random.Random(0).shuffle(prompts)
    rows = []
    for router in ("round_robin", "prefix"):
        deploy(2, router)
        wall, ttfts = asyncio.run(completions(url, prompts, 4, args.routing_concurrency))
        hits = metric(url, "tokenriver_prefix_cache_hit_tokens_total")
        queried = metric(url, "tokenriver_prefix_cache_queried_tokens_total")
        ordered = sorted(ttfts)
        rows.append(
            [
                router,
                len(prompts),
                wall,
                1000 * statistics.median(ttfts),
                1000 * ordered[int(0.9 * (len(ordered) - 1))],
                f"{100 * hits / queried:.1f}%",
            ]
        )
    return (
        "## Routing: prefix-aware vs round robin (2 replicas)\n\n"
        f"8 system prompts (~{len(prompts[0].split())} words each) x {args.routing_users} users in a seeded random "
        f"order, "
        f"{args.routing_concurrency} requests in flight, 4 output tokens each. Hit rate = prompt tokens served "
        "from the replicas' prefix caches / prompt tokens looked up (aggregated /metrics).\n\n"
        + markdown_table(["router", "requests", "wall s", "TTFT p50 ms", "TTFT p90 ms", "prefix-cache hit rate"], rows)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--parts", nargs="+", default=["tp", "replicas", "routing"], choices=["tp", "replicas", "routing"]
    )
    parser.add_argument("--tp-batch", type=int, default=4)
    parser.add_argument("--tp-tokens", type=int, default=32)
    parser.add_argument("--replica-requests", type=int, default=32)
    parser.add_argument("--replica-tokens", type=int, default=32)
    parser.add_argument("--replica-concurrency", type=int, default=16)
    parser.add_argument("--routing-users", type=int, default=48)
    parser.add_argument("--routing-concurrency", type=int, default=4)
    parser.add_argument("--output", default=str(RESULTS / "scale_out.md"))
    args = parser.parse_args()
    sections = [
        f"- machine: {machine_line()}; 1-minute load average {load_average()} at the start (a shared "
        "machine: other people's work ran on the same 2 cores during these runs)"
    ]
    if "tp" in args.parts:
        sections.append(run_tp(args))
    if {"replicas", "routing"} & set(args.parts):
        import ray
        from ray import serve

        port = free_port()
        # Ray's worker processes import tokenriver too: from this checkout, as this script does.
        source = str(Path(__file__).resolve().parents[1] / "src")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        try:
            if "replicas" in args.parts:
                sections.append(run_replicas(args, url))
            if "routing" in args.parts:
                sections.append(run_routing(args, url))
        finally:
            serve.shutdown()
            ray.shutdown()
    text = (
        "# Scale-out: replicas, routing, tensor parallelism\n\n"
        f"Command: `python benchmarks/scale_out.py --parts {' '.join(args.parts)}`\n\n" + "\n\n".join(sections) + "\n"
    )
    Path(args.output).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
