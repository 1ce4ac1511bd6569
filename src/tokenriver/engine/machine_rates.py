"""The machine's two ceilings for a forward pass, measured: memory read bandwidth and arithmetic rate.

A pass over a small batch reads every weight once and does a multiply-add or two per byte; a long prefill does
hundreds per byte. Which ceiling a pass meets is the roofline: its rate is at most
min(flops_per_second, intensity × read_bytes_per_second), intensity being its FLOPs per byte read. Both ceilings are
measured here, in well under a second, on the engine's device with the threads it computes with:
- read bandwidth: a sum over a float32 array far larger than the caches (STREAM's reduction, the measure
  benchmarks/bandwidth.py takes over 1 GiB), best of a few runs;
- arithmetic rate: a square float32 matrix product, 2·n³ FLOPs, best of a few runs.
They are what plain float32 torch kernels reach: no pass reads faster than the bandwidth; the engine's packed integer
kernels may compute faster than the float32 product, which the visualizer says.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# float32 elements summed: 256 MiB, beyond any cache the bandwidth could be mistaken for.
_READ_ELEMENTS = 2**26
# Side of the square product: enough work for the kernels to reach their rate (a GPU needs a larger one).
_MATMUL_SIDE = {"cpu": 1024, "cuda": 4096}
# Timed runs of each; the best is kept: on a shared machine the fastest run is the one least disturbed.
_RUNS = 5


@dataclass(frozen=True)
class MachineRates:
    """What one device reached, in bytes and FLOPs per second."""

    device: str
    num_threads: int
    read_bytes_per_second: float
    flops_per_second: float
    # Wall seconds both measurements took.
    seconds: float

    @property
    def ridge_intensity(self) -> float:
        """FLOPs per byte where the two ceilings meet: a pass below it is bound by memory, above it by arithmetic."""
        return self.flops_per_second / self.read_bytes_per_second


def measure_machine_rates(device: str) -> MachineRates:
    """Measure `device`'s read bandwidth and float32 product rate now (module docstring)."""
    started = time.perf_counter()
    torch_device = torch.device(device)
    data = torch.ones(_READ_ELEMENTS, dtype=torch.float32, device=torch_device)  # [64 Mi] float32, 256 MiB
    read_seconds = _best_seconds(data.sum, torch_device)
    read_rate = data.numel() * data.element_size() / read_seconds
    del data
    side = _MATMUL_SIDE.get(torch_device.type, _MATMUL_SIDE["cpu"])
    left = torch.rand(side, side, dtype=torch.float32, device=torch_device)  # [n, n]
    right = torch.rand(side, side, dtype=torch.float32, device=torch_device)  # [n, n]
    product_seconds = _best_seconds(lambda: left @ right, torch_device)
    return MachineRates(
        device=str(torch_device),
        num_threads=torch.get_num_threads(),
        read_bytes_per_second=read_rate,
        flops_per_second=2 * side**3 / product_seconds,
        seconds=time.perf_counter() - started,
    )


def _best_seconds(work: Callable[[], object], device: torch.device) -> float:
    """The shortest of a few timed runs of `work`, after one untimed run (caches, lazy kernel set-up)."""
    work()
    best = float("inf")
    for _ in range(_RUNS):
        _synchronize(device)
        started = time.perf_counter()
        work()
        _synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
