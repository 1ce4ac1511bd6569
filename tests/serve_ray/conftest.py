"""A local Ray with a tokenriver Serve application on it, for the tests of this package that need one."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tokenriver.config import EngineConfig
from tokenriver.server.config import ServerConfig


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def ray_cluster() -> Iterator[int]:
    """Ray on this machine's 2 cores and Serve's HTTP proxy on a free port; yields the port."""
    ray = pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")
    serve = pytest.importorskip("ray.serve", reason="needs the ray extra: pip install -e '.[ray]'")
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(num_replicas: int = 2, router: str = "prefix", **router_kwargs: object) -> None:
    """(Re)deploy the application with fresh replicas of the embedded model, one CPU and thread each."""
    from ray import serve

    from tokenriver.serve_ray.app import build_application

    serve.delete("tokenriver")
    # The defaults: the tests compare replicas' texts with one engine's, and a request gets the same tokens whatever
    # batch it runs in (docs/models.md, exact by default).
    config = EngineConfig.from_flat(max_num_kv_tokens=4096, num_threads=1)
    serve.run(
        build_application(config, ServerConfig(), num_replicas, router, router_kwargs or None),
        name="tokenriver",
        route_prefix="/",
    )
