"""Run the server: load the engine, bind, serve with uvicorn, and shut down gracefully.

SIGTERM (or Ctrl-C) stops accepting connections, lets running requests
finish for up to `shutdown_timeout` seconds (then cancels them, which aborts
their engine requests), stops the engine, and exits with status 0.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import socket
import sys
import time
import webbrowser
from collections.abc import Iterator

import uvicorn

from tokenriver.config import EngineConfig
from tokenriver.engine.async_engine import AsyncEngine
from tokenriver.errors import InvalidParameterError
from tokenriver.server.app import build_app, served_model_name
from tokenriver.server.config import ServerConfig

logger = logging.getLogger("tokenriver.server")


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, except that the signal that stopped it is not re-raised after the graceful shutdown.

    uvicorn re-raises it so the default handler kills the process (exit status -15 for SIGTERM);
    a server that drained cleanly should exit 0.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _bind(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a taken port fails in a second rather than after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise InvalidParameterError(
            f"cannot listen on {host}:{port} ({error.strerror}); pick another --port or --host", param="port"
        ) from None
    sock.set_inheritable(True)
    return sock


def server_url(host: str, port: int) -> str:
    """The URL to print: a wildcard address is shown as loopback, which a local browser can open."""
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"


def _describe(engine: AsyncEngine) -> str:
    info = engine.model_info
    kv_tokens = info.num_kv_blocks * info.block_size
    return (
        f"model {info.path} ({info.weights}); KV pool {info.num_kv_blocks} blocks "
        f"x {info.block_size} tokens = {kv_tokens} tokens ({info.kv_cache_bytes / 2**20:.0f} MiB, "
        f"{info.kv_cache_dtype}); max_model_len {info.max_model_len}, max_num_seqs {info.max_num_seqs}, "
        f"max_waiting_requests {info.max_waiting_requests}"
    )


def run_server(
    engine_config: EngineConfig, server_config: ServerConfig, *, visualizer: bool = False, open_browser: bool = False
) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit status.

    `visualizer` prints the visualizer's URL on stdout; `open_browser` also tries to open it.
    """
    logging.basicConfig(
        level=server_config.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sock = _bind(server_config.host, server_config.port)
    started = time.monotonic()
    engine = AsyncEngine(engine_config)
    # The model and tokenizer live as long as this process: frozen, the collector stops walking their objects (a
    # 262k-token vocabulary is hundreds of thousands) on every full collection the requests trigger.
    gc.freeze()
    try:
        # Queued now, so the engine thread measures the machine while idle, before the first request (a fraction
        # of a second): the visualizer's roofline is ready when the page opens.
        engine.machine_rates()
        app = build_app(engine, server_config)
        url = server_url(server_config.host, sock.getsockname()[1])
        logger.info("loaded in %.1f s: %s", time.monotonic() - started, _describe(engine))
        if engine.model_info.memory:
            logger.info("%s", engine.model_info.memory)
        logger.info(
            "tokenriver serving %r at %s (OpenAI API under %s/v1, metrics at %s/metrics)",
            served_model_name(engine, server_config),
            url,
            url,
            url,
        )
        if visualizer:
            print(f"visualizer: {url}/", flush=True)
            if open_browser and not webbrowser.open(f"{url}/"):
                logger.info("no browser could be opened; open %s/ yourself", url)
        uvicorn_config = uvicorn.Config(
            app,
            log_level=server_config.log_level,
            access_log=False,
            timeout_graceful_shutdown=server_config.shutdown_timeout,
        )
        _GracefulServer(uvicorn_config).run(sockets=[sock])
    finally:
        engine.shutdown(timeout=10)
        sock.close()
    logger.info("tokenriver server stopped")
    return 0
