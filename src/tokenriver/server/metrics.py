"""Prometheus metrics of one server: a registry per app, so two apps in one process never share counters.

Two kinds of numbers. Request-level ones (tokens, latencies, HTTP statuses)
are recorded by the HTTP layer as outputs stream past, so they measure what a
client experiences. Engine-level ones (running and waiting requests, KV-cache
usage, prefix-cache hit rate, preemptions) are read live from the scheduler at
scrape time by `_EngineCollector`, so /metrics is exact even when the engine
is idle (an aborted request frees its blocks without another step running).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenriver.engine.async_engine import AsyncEngine
from tokenriver.outputs import RequestOutput

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0)


class _EngineCollector(Collector):
    """Scheduler and KV-pool state, read when Prometheus scrapes."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        # The scheduler lives on the engine thread; its stats() only reads counters and list lengths.
        stats = self.engine.snapshot().scheduler
        gauges = (
            (
                "tokenriver_num_requests_running",
                "Engine requests in the running batch (n > 1 counts n).",
                stats.num_running,
            ),
            (
                "tokenriver_num_requests_waiting",
                "Engine requests waiting for KV blocks or a batch slot.",
                stats.num_waiting,
            ),
            ("tokenriver_kv_cache_usage_ratio", "Fraction of KV blocks held by requests (0..1).", stats.kv_usage),
            ("tokenriver_kv_cache_blocks_used", "KV blocks held by requests.", stats.num_blocks_used),
            (
                "tokenriver_kv_cache_blocks_free",
                "KV blocks nobody holds (cached prefixes included).",
                stats.num_blocks_free,
            ),
            ("tokenriver_kv_cache_blocks_total", "KV blocks in the pool.", stats.num_blocks_total),
            (
                "tokenriver_prefix_cache_hit_rate",
                "Share of looked-up prompt tokens found in the prefix cache.",
                stats.prefix_cache_hit_rate,
            ),
        )
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)
        counters = (
            (
                "tokenriver_num_preemptions",
                "Requests that lost their KV blocks and were recomputed.",
                stats.num_preempted_total,
            ),
            (
                "tokenriver_prefix_cache_queried_tokens",
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_cache_queried_tokens,
            ),
            (
                "tokenriver_prefix_cache_hit_tokens",
                "Prompt tokens served from the prefix cache.",
                stats.prefix_cache_hit_tokens,
            ),
            ("tokenriver_engine_steps", "Non-empty engine steps.", stats.num_steps),
            (
                "tokenriver_spec_decode_num_draft_tokens",
                "Speculative draft tokens verified by the model.",
                stats.num_draft_tokens_total,
            ),
            (
                "tokenriver_spec_decode_num_accepted_tokens",
                "Speculative draft tokens the model accepted.",
                stats.num_accepted_draft_tokens_total,
            ),
            (
                "tokenriver_spec_decode_num_rejected_tokens",
                "Speculative draft tokens the model rejected.",
                stats.num_rejected_draft_tokens_total,
            ),
            (
                "tokenriver_spec_decode_num_verifications",
                "Verification passes that carried draft tokens.",
                stats.num_speculative_steps_total,
            ),
        )
        for name, documentation, value in counters:
            yield CounterMetricFamily(name, documentation, value=value)


class ServerMetrics:
    """The app's registry and the request-level metrics the HTTP layer records."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "tokenriver_http_requests",
            "HTTP requests by route and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.finished_requests = Counter(
            "tokenriver_request_finished",
            "Returned candidates by finish reason.",
            ["finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "tokenriver_prompt_tokens", "Prompt tokens of admitted requests.", registry=self.registry
        )
        self.generation_tokens = Counter("tokenriver_generation_tokens", "Generated tokens.", registry=self.registry)
        self.rejected_requests = Counter(
            "tokenriver_requests_rejected",
            "Requests refused with 429: max_waiting_requests were already waiting.",
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "tokenriver_time_to_first_token_seconds",
            "From request received to its first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "tokenriver_inter_token_latency_seconds",
            "Gap between consecutive generated tokens of a candidate.",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "tokenriver_e2e_request_latency_seconds",
            "From request received to its last token.",
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine))

    def observe_http(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observer(self) -> RequestObserver:
        """Start timing one engine request (call when the HTTP request arrives)."""
        return RequestObserver(self)

    def render(self) -> bytes:
        """The Prometheus text exposition of everything in this app's registry."""
        return generate_latest(self.registry)


class RequestObserver:
    """Turns one request's stream of RequestOutputs into latency and token metrics."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.started = time.monotonic()
        # Per candidate index: tokens seen so far and when the last of them arrived.
        self._num_tokens: dict[int, int] = {}
        self._last_token_time: dict[int, float] = {}
        self._has_first_token = False
        self._is_admitted = False
        self._is_done = False

    def on_output(self, output: RequestOutput) -> None:
        now = time.monotonic()
        if not self._is_admitted:
            self._is_admitted = True
            self.metrics.prompt_tokens.inc(len(output.prompt_token_ids))
        for candidate in output.outputs:
            num_new = len(candidate.token_ids) - self._num_tokens.get(candidate.index, 0)
            if num_new <= 0:
                continue
            if not self._has_first_token:
                self._has_first_token = True
                self.metrics.time_to_first_token.observe(now - self.started)
            elif candidate.index in self._last_token_time:
                gap = (now - self._last_token_time[candidate.index]) / num_new
                for _ in range(num_new):
                    self.metrics.inter_token_latency.observe(gap)
            self.metrics.generation_tokens.inc(num_new)
            self._num_tokens[candidate.index] = len(candidate.token_ids)
            self._last_token_time[candidate.index] = now
        if output.finished and not self._is_done:
            self._is_done = True
            self.metrics.e2e_latency.observe(now - self.started)
            for candidate in output.outputs:
                reason = candidate.finish_reason.value if candidate.finish_reason else "unknown"
                self.metrics.finished_requests.labels(finish_reason=reason).inc()

    def on_rejected(self) -> None:
        """The engine refused the request: its waiting queue was full."""
        if not self._is_done:
            self._is_done = True
            self.metrics.rejected_requests.inc()

    def on_abort(self) -> None:
        """The client went away (or the request failed) before the request finished."""
        if not self._is_done:
            self._is_done = True
            self.metrics.finished_requests.labels(finish_reason="abort").inc()
