"""Start and stop a real `tokenriver serve` (`python -m tokenriver.cli serve`) on 127.0.0.1 in a subprocess.

The server gets a small KV pool, a short context and a small body limit, so
the limits are cheap to hit in tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

from tokenriver.models.cpu.kernels import load_kernels

API_KEY = "test-key"
MAX_MODEL_LEN = 512
MAX_BODY_SIZE = 64 * 1024
NUM_KV_TOKENS = 2048
STARTUP_TIMEOUT = 240.0
SERVER_ARGS = [
    "--port",
    "0",
    "--api-key",
    API_KEY,
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-num-kv-tokens",
    str(NUM_KV_TOKENS),
    "--max-body-size",
    str(MAX_BODY_SIZE),
    "--max-num-seqs",
    "32",
]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str
    log_path: str
    api_key: str = API_KEY

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as log:
            return log.read()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def metric(self, name: str) -> float:
        """One unlabelled sample of GET /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert match, f"{name} not in /metrics"
        return float(match.group(1))


def start_server(extra_args: list[str] | None = None) -> ServerProcess:
    """`python -m tokenriver.cli serve` on a free port; returns once /health answers 200."""
    log = tempfile.NamedTemporaryFile("w", prefix="tokenriver-serve-", suffix=".log", delete=False)
    command = [sys.executable, "-m", "tokenriver.cli", "serve", *SERVER_ARGS, *(extra_args or [])]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    server = ServerProcess(process, "", log.name)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{server.log()}")
        match = re.search(r"tokenriver serving .* at (http://127\.0\.0\.1:\d+)", server.log())
        if match:
            server.url = match.group(1)
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    _check_the_kernels_loaded(server)
                    return server
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"the server did not start within {STARTUP_TIMEOUT} s:\n{server.log()}")


def _check_the_kernels_loaded(server: ServerProcess) -> None:
    """A server without the native kernels this process has runs other numerics, and every comparison with
    LLM.generate here would fail on text: fail on the cause instead."""
    log = server.log()
    if load_kernels() is not None and "native kernels off" in log:
        stop_server(server)
        raise RuntimeError(f"the server runs without the native kernels this process has:\n{log}")


def stop_server(server: ServerProcess) -> None:
    if server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    os.unlink(server.log_path)
