"""The tensor-parallel process group: which rank this process is, and the two collectives a step needs.

A step needs an all-reduce after every row-parallel projection (the attention block's o_proj and the MLP's
down_proj: each rank holds a partial sum of the same output) and, once per step, a broadcast of rank 0's plan
(the SchedulerOutput, plain data) so every rank runs the same forward pass. gloo carries both on the CPU, NCCL on
CUDA. The time spent inside all-reduces is counted here, so a benchmark can tell communication from compute.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tokenriver.errors import InvalidParameterError

# How long a rank waits for the others (rendezvous, or a collective whose peer is gone) before giving up.
DEFAULT_TIMEOUT = timedelta(minutes=5)


def backend_for(device: str) -> str:
    """NCCL for CUDA tensors, gloo for everything on the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_local_address() -> str:
    """host:port of a TCP port free right now on the loopback interface, for a one-machine rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def init_method_for(address: str | None) -> str:
    """A rendezvous URL from --distributed-init-addr: host:port → tcp://host:port; None or 'env' → env://
    (MASTER_ADDR / MASTER_PORT, as torchrun sets them)."""
    if address is None or address == "env" or address == "env://":
        return "env://"
    if address.startswith("tcp://"):
        return address
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidParameterError(
            f"distributed_init_addr={address!r} is not host:port, e.g. head-node.example:29500",
            param="distributed_init_addr",
        )
    return f"tcp://{address}"


@dataclass
class CollectiveTimes:
    """Seconds spent in collectives since start, and how many there were."""

    gather_seconds: float = 0.0
    num_gathers: int = 0
    broadcast_seconds: float = 0.0
    num_broadcasts: int = 0


class TensorParallelGroup:
    """This process's place in the group, and the collectives a sharded model calls."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.times = CollectiveTimes()

    @classmethod
    def connect(
        cls, rank: int, world_size: int, init_method: str, device: str, timeout: timedelta = DEFAULT_TIMEOUT
    ) -> TensorParallelGroup:
        """Join the group (blocks until all world_size ranks have joined). One group per process."""
        if dist.is_initialized():
            raise InvalidParameterError(
                "this process already belongs to a torch.distributed group; one tensor-parallel engine per process",
                param="tensor_parallel_size",
            )
        torch_device = torch.device(device)
        if torch_device.type == "cuda":
            torch.cuda.set_device(torch_device)
        dist.init_process_group(
            backend_for(device), init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
        )
        return cls(rank, world_size, torch_device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (the same shape on each), stacked in rank order: [world_size, *tensor.shape]."""
        started = time.perf_counter()
        gathered = tensor.new_empty((self.world_size * tensor.shape[0], *tensor.shape[1:]))
        dist.all_gather_single(gathered, tensor.contiguous())  # ranks' tensors concatenated along dim 0
        self.times.gather_seconds += time.perf_counter() - started
        self.times.num_gathers += 1
        return gathered.view(self.world_size, *tensor.shape)

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's obj on every rank (the others pass nothing). For plain data only: it travels pickled between
        the group's own processes."""
        started = time.perf_counter()
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        self.times.broadcast_seconds += time.perf_counter() - started
        self.times.num_broadcasts += 1
        return box[0]

    def close(self) -> None:
        """Leave the group (another can be joined afterwards)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def env_rank() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) when a torchrun-style launcher started this process, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None
