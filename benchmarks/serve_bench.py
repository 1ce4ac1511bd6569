"""The HTTP server under load: N concurrent streaming clients, each sending a few requests back to back.

For each concurrency level N (default 1, 4, 16, 32), N clients each send
--requests-per-client streaming completions of exactly --max-tokens tokens
(ignore_eos) to a server on the loopback interface, one after the other.
Reported per level: requests/s and output tokens/s over the level's wall
time, time to first token (request sent → first token chunk) and inter-token
latency (gap between token chunks) at p50 and p99, and the request ledger:
completed + errored == sent, always (a level's deadline cancels what is left
and counts it as errored).

    python benchmarks/serve_bench.py                      # starts its own server (small KV pool)
    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --api-key KEY

Writes benchmarks/results/serve_bench.md.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

from common import RESULTS, machine_line, markdown_table

TOPICS = ["a lighthouse", "a river", "a clockmaker", "the moon", "a library", "a fox", "a storm", "a garden"]


@dataclass
class RequestResult:
    ok: bool
    # Seconds from sending the request to its first token chunk.
    time_to_first_token: float | None = None
    # Gaps between consecutive token chunks, seconds.
    inter_token_latencies: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    error: str | None = None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


async def stream_one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(ok=False)
    sent = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
                if any(choice.get("text") for choice in chunk["choices"]):
                    now = time.perf_counter()
                    if result.time_to_first_token is None:
                        result.time_to_first_token = now - sent
                    else:
                        result.inter_token_latencies.append(now - last)
                    last = now
        result.ok = result.num_output_tokens == max_tokens
        if not result.ok:
            result.error = f"got {result.num_output_tokens} tokens instead of {max_tokens}"
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


async def run_level(
    url: str,
    headers: dict[str, str],
    model: str,
    num_clients: int,
    requests_per_client: int,
    max_tokens: int,
    deadline_seconds: float,
) -> tuple[list[RequestResult], int, float]:
    """All clients of one level; returns every sent request's result, the number sent, and the wall time."""
    results: list[RequestResult] = []
    num_sent = 0
    limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)

    async def client_loop(client: httpx.AsyncClient, index: int) -> None:
        nonlocal num_sent
        for turn in range(requests_per_client):
            topic = TOPICS[(index + turn) % len(TOPICS)]
            prompt = f"Client {index}, request {turn}: write a short story about {topic}."
            # A placeholder first, so a request cut off by the deadline is still counted (as errored).
            slot = len(results)
            results.append(RequestResult(ok=False, error="cancelled at the level's deadline"))
            num_sent += 1
            results[slot] = await stream_one(client, model, prompt, max_tokens)

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=deadline_seconds, limits=limits) as client:
        tasks = [asyncio.create_task(client_loop(client, i)) for i in range(num_clients)]
        _, pending = await asyncio.wait(tasks, timeout=deadline_seconds)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return results, num_sent, time.perf_counter() - started


def summarize(num_clients: int, results: list[RequestResult], sent: int, elapsed: float) -> list[object]:
    completed = [r for r in results if r.ok]
    num_errored = sum(1 for r in results if not r.ok)
    if len(completed) + num_errored != sent:
        raise SystemExit(f"{sent} requests sent but {len(completed)} completed and {num_errored} errored")
    ttfts = [r.time_to_first_token for r in completed if r.time_to_first_token is not None]
    itls = [gap for r in completed for gap in r.inter_token_latencies]
    output_tokens = sum(r.num_output_tokens for r in results)

    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 1000:.0f}"

    return [
        num_clients,
        sent,
        len(completed),
        num_errored,
        elapsed,
        len(completed) / elapsed,
        output_tokens / elapsed,
        ms(percentile(ttfts, 50)),
        ms(percentile(ttfts, 99)),
        ms(percentile(itls, 50)),
        ms(percentile(itls, 99)),
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, str]:
    """`tokenriver serve` on a free loopback port (access log off); returns (process, url, log path)."""
    log = tempfile.NamedTemporaryFile("w", prefix="serve-bench-", suffix=".log", delete=False)
    url = f"http://127.0.0.1:{_free_port()}"
    command = [
        sys.executable,
        "-m",
        "tokenriver.cli",
        "serve",
        "--port",
        url.rsplit(":", 1)[1],
        "--log-level",
        "warning",
        "--max-num-seqs",
        str(max(args.concurrency)),
        "--max-num-kv-tokens",
        str(args.kv_tokens),
    ]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url, log.name
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"the server did not start within 300 s; see {log.name}")


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        is_loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        is_loopback = False
    if not is_loopback:
        raise SystemExit(f"{url} is not on the loopback interface; this benchmark only loads local servers")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an already running server (loopback only); default: start one")
    parser.add_argument("--api-key", default=os.environ.get("TOKENRIVER_API_KEY"))
    parser.add_argument("--concurrency", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16, 32])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kv-tokens", type=int, default=8192, help="KV pool of the started server, in tokens")
    parser.add_argument("--level-timeout", type=float, default=300.0, help="deadline of one concurrency level, s")
    parser.add_argument("--output", default=str(RESULTS / "serve_bench.md"))
    args = parser.parse_args()

    load_at_start = os.getloadavg()[0]
    process, log_path = None, None
    if args.url:
        check_loopback(args.url)
        url = args.url.rstrip("/")
    else:
        process, url, log_path = start_server(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
        engine = httpx.get(url + "/v1/engine", headers=headers, timeout=10).json()
        asyncio.run(run_level(url, headers, model, 1, 1, 8, args.level_timeout))  # warm-up
        rows = []
        for num_clients in args.concurrency:
            results, sent, elapsed = asyncio.run(
                run_level(
                    url, headers, model, num_clients, args.requests_per_client, args.max_tokens, args.level_timeout
                )
            )
            row = summarize(num_clients, results, sent, elapsed)
            errors = sorted({r.error for r in results if not r.ok and r.error})
            print(
                f"{num_clients:>3} clients: {row[2]}/{sent} completed in {elapsed:.1f} s, {row[5]:.2f} req/s, "
                f"{row[6]:.1f} tok/s, TTFT p50 {row[7]} ms, ITL p50 {row[9]} ms"
                + (f"; errors: {errors[:3]}" if errors else ""),
                flush=True,
            )
            rows.append(row)
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
            os.unlink(log_path)

    headers_row = [
        "clients",
        "sent",
        "completed",
        "errored",
        "wall s",
        "req/s",
        "output tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
    ]
    report = [
        "# Serving benchmark: concurrent streaming clients over HTTP",
        "",
        f"Command: `{' '.join(['python', 'benchmarks/serve_bench.py', *sys.argv[1:]])}`",
        "",
        f"- machine: {machine_line()}; 1-minute load average {load_at_start:.1f} at the start (other processes "
        f"sharing the cores count in it)",
        f"- server: model {model}, {engine['dtype']}, KV pool {engine['num_blocks']} blocks x "
        f"{engine['block_size']} tokens, max_num_batched_tokens {engine['max_num_batched_tokens']}, "
        f"max_num_seqs {engine['max_num_seqs']}, loopback HTTP",
        f"- load: each client sends {args.requests_per_client} streaming completions one after the other, each "
        f"exactly {args.max_tokens} output tokens (ignore_eos, temperature 0.8); TTFT = request sent → first token "
        f"chunk, ITL = gap between token chunks; completed + errored == sent",
        "",
        markdown_table(headers_row, rows),
        "",
    ]
    with open(args.output, "w", encoding="utf-8") as out:
        out.write("\n".join(report))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
