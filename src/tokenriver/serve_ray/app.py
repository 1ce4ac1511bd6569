"""The Ray Serve application: N engine replicas behind one ingress, and how to start it.

    ingress (1 replica, no CPU reserved) ──handle, PrefixAwareRouter──▶ engine replicas (N, one CPU share each)

`build_application` composes it; `run_data_parallel` is `tokenriver serve --data-parallel-size N` (a local Ray, or
the cluster at RAY_ADDRESS); `app_builder` is the entry point for `serve run` and Serve config files on an existing
cluster (docs/scaling.md):

    serve run tokenriver.serve_ray.app:app_builder num_replicas=4 model=/models/m.gguf
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from tokenriver.config import EngineConfig
from tokenriver.errors import InvalidParameterError
from tokenriver.serve_ray.ingress import Ingress
from tokenriver.serve_ray.replica import EngineReplica
from tokenriver.serve_ray.router import PrefixAwareRouter, RoundRobinRouter
from tokenriver.server.config import ServerConfig

logger = logging.getLogger("tokenriver.serve_ray")

ROUTERS = {"prefix": PrefixAwareRouter, "round_robin": RoundRobinRouter}
# How often each replica reports load and KV usage to the routers (seconds).
ROUTING_STATS_PERIOD_S = 1.0


def build_application(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    num_replicas: int,
    router: str = "prefix",
    router_kwargs: dict[str, Any] | None = None,
    cpus_per_replica: float = 1.0,
    max_ongoing_requests: int = 256,
) -> Any:
    """The bound Serve application: an Ingress over `num_replicas` EngineReplica deployments."""
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise InvalidParameterError(
            f"data_parallel_size={num_replicas!r} must be an integer >= 1", param="data_parallel_size"
        )
    if router not in ROUTERS:
        raise InvalidParameterError(f"router={router!r} is not one of {sorted(ROUTERS)}", param="router")
    if engine_config.parallel.num_threads is None:
        parallel = dataclasses.replace(engine_config.parallel, num_threads=max(1, int(cpus_per_replica)))
        engine_config = dataclasses.replace(engine_config, parallel=parallel)
    engines = serve.deployment(
        EngineReplica,
        name="TokenriverEngine",
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": cpus_per_replica},
        max_ongoing_requests=max_ongoing_requests,
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[router],
            request_router_kwargs=router_kwargs or {},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
    ).bind(engine_config, server_config)
    ingress = serve.deployment(
        Ingress,
        name="TokenriverIngress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=4 * max_ongoing_requests,
    )
    return ingress.bind(engines, engine_config)


def app_builder(args: dict[str, Any]) -> Any:
    """`serve run tokenriver.serve_ray.app:app_builder key=value ...` or a config file's `args`: num_replicas,
    router (prefix | round_robin), cpus_per_replica, and any EngineConfig field (model, quantization, ...)."""
    args = dict(args)
    num_replicas = int(args.pop("num_replicas", 1))
    router = str(args.pop("router", "prefix"))
    cpus = float(args.pop("cpus_per_replica", 1.0))
    fields = EngineConfig.flat_fields()
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise InvalidParameterError(
            f"unknown argument(s) {unknown}: use num_replicas, router, cpus_per_replica or EngineConfig fields",
            param=unknown[0],
        )
    engine_args = {name: _coerce(fields[name].type, value) for name, value in args.items()}
    return build_application(
        EngineConfig.from_flat(**engine_args), ServerConfig(), num_replicas, router, cpus_per_replica=cpus
    )


def _coerce(annotation: Any, value: Any) -> Any:
    """Command-line args arrive as strings: turn them into the field's type."""
    if not isinstance(value, str):
        return value
    text = str(annotation)
    if text.startswith("bool"):
        return value.lower() in ("1", "true", "yes")
    if text.startswith("int"):
        return int(value)
    if text.startswith("float"):
        return float(value)
    return value


def run_data_parallel(
    engine_config: EngineConfig, server_config: ServerConfig, num_replicas: int, router: str = "prefix"
) -> int:
    """`tokenriver serve --data-parallel-size N`: start (or join, with RAY_ADDRESS) Ray, deploy, serve until
    SIGINT/SIGTERM, then tear the application down."""
    import ray

    logging.basicConfig(level=server_config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ray.init(ignore_reinit_error=True, log_to_driver=server_config.log_level == "debug")
    serve.start(http_options={"host": server_config.host, "port": server_config.port})
    serve.run(
        build_application(engine_config, server_config, num_replicas, router), name="tokenriver", route_prefix="/"
    )
    logger.info(
        "tokenriver serving %d replicas at http://%s:%d (aggregated metrics at /metrics, per replica at "
        "/metrics/replicas)",
        num_replicas,
        server_config.host,
        server_config.port,
    )
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the teardown short
        signal.signal(sig, signal.SIG_IGN)
    serve.shutdown()
    ray.shutdown()
    return 0
