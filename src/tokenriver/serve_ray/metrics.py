"""Prometheus text from several replicas: summed into one view, or kept apart under a `replica` label.

Counters, histogram buckets/sums/counts and the load gauges (running, waiting, KV blocks) add up across replicas.
Ratios (KV usage, prefix-cache hit rate) do not: the aggregate recomputes them from the summed counts.
"""

from __future__ import annotations

import re
from collections import OrderedDict

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
# Gauges that are ratios: recomputed from summed parts instead of added.
_RATIOS = {
    "tokenriver_kv_cache_usage_ratio": ("tokenriver_kv_cache_blocks_used", "tokenriver_kv_cache_blocks_total"),
    "tokenriver_prefix_cache_hit_rate": (
        "tokenriver_prefix_cache_hit_tokens_total",
        "tokenriver_prefix_cache_queried_tokens_total",
    ),
}


def parse_samples(text: str) -> tuple[list[str], OrderedDict[str, float]]:
    """(the # HELP / # TYPE lines, sample "name{labels}" → value) of one exposition."""
    comments, samples = [], OrderedDict()
    for line in text.splitlines():
        if line.startswith("#"):
            comments.append(line)
            continue
        match = _SAMPLE.match(line.strip())
        if match:
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return comments, samples


def aggregate(texts: list[str]) -> str:
    """One exposition whose samples are the sums over the replicas' (ratios recomputed)."""
    comments: list[str] = []
    totals: OrderedDict[str, float] = OrderedDict()
    for text in texts:
        lines, samples = parse_samples(text)
        comments.extend(line for line in lines if line not in comments)
        for key, value in samples.items():
            if key.partition("{")[0].endswith("_created"):
                continue  # a start timestamp, meaningless summed
            totals[key] = totals.get(key, 0.0) + value
    for ratio, (part, whole) in _RATIOS.items():
        if ratio in totals:
            denominator = totals.get(whole, 0.0)
            totals[ratio] = totals.get(part, 0.0) / denominator if denominator else 0.0
    return _render(comments, totals)


def label_replica(text: str, replica: str) -> str:
    """The exposition with replica="<id>" added to every sample (no comment lines)."""
    out = []
    for key, value in parse_samples(text)[1].items():
        name, brace, labels = key.partition("{")
        label = f'replica="{replica}"'
        out.append(f"{name}{{{label},{labels}" if brace else f"{name}{{{label}}}")
        out[-1] += f" {_number(value)}"
    return "\n".join(out) + "\n"


def _render(comments: list[str], samples: OrderedDict[str, float]) -> str:
    by_name: OrderedDict[str, list[str]] = OrderedDict()
    for line in comments:
        parts = line.split(maxsplit=3)
        if len(parts) >= 3:
            by_name.setdefault(parts[2], []).append(line)
    out, emitted = [], set()
    for key, value in samples.items():
        name = key.partition("{")[0]
        family = max((f for f in by_name if name == f or name.startswith(f + "_")), key=len, default=None)
        if family is not None and family not in emitted:
            out.extend(by_name[family])
            emitted.add(family)
        out.append(f"{key} {_number(value)}")
    return "\n".join(out) + "\n"


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)
