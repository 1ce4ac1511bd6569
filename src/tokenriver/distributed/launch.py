"""Starting the ranks of a tensor-parallel engine (`tensor_parallel_size` > 1), torchrun-style.

One process per rank. Rank 0 is the engine (scheduler, tokenizer, server); ranks 1.. each load the model, keep
their shard of it (distributed/sharding.py) and run the plans rank 0 broadcasts (distributed/runner.py).
How the processes come to exist:
- one machine: rank 0 picks a free loopback port and spawns ranks 1..N-1 itself;
- several machines (`nnodes` > 1): every machine runs the same command with its own `node_rank` and the head's
  `distributed_init_addr`; node r hosts ranks r * N / nnodes .. (r + 1) * N / nnodes - 1 and spawns them, and only
  node 0 runs the engine;
- under torchrun (RANK and WORLD_SIZE set): each process is one rank, rendezvous through env://.
Each rank runs torch on its share of the machine's threads (all of them divided by the ranks on the machine).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass

import torch

from tokenriver.config import EngineConfig, default_num_threads
from tokenriver.distributed.group import TensorParallelGroup, env_rank, free_local_address, init_method_for
from tokenriver.distributed.runner import TensorParallelRunner, serve_steps
from tokenriver.distributed.sharding import ShardLayout, shard_model
from tokenriver.errors import InvalidParameterError
from tokenriver.kv.cache import KVCache
from tokenriver.loader.load import LoadedModel, load_model
from tokenriver.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class RankPlacement:
    """Where ranks live: the rendezvous URL and the ranks this machine hosts."""

    init_method: str
    # Ranks this process's machine starts, the first of them in this very process.
    local_ranks: range
    # Whether a launcher (torchrun) started every rank: nothing to spawn.
    launched: bool


def placement(config: EngineConfig) -> RankPlacement:
    """This machine's ranks (module docstring)."""
    parallel = config.parallel
    world_size = parallel.tensor_parallel_size
    launched = env_rank()
    if launched is not None:
        rank, env_world_size = launched
        if env_world_size != world_size:
            raise InvalidParameterError(
                f"WORLD_SIZE={env_world_size} (from the launcher) but tensor_parallel_size={world_size}: start "
                f"one process per rank",
                param="tensor_parallel_size",
            )
        return RankPlacement("env://", range(rank, rank + 1), True)
    per_node = world_size // parallel.nnodes
    first = parallel.node_rank * per_node
    address = parallel.distributed_init_addr or free_local_address()
    return RankPlacement(init_method_for(address), range(first, first + per_node), False)


def _rank_device(config: EngineConfig, rank: int, ranks_per_node: int) -> str:
    """cuda:<local rank> under CUDA (one GPU per rank; LOCAL_RANK where a launcher set it), else the configured
    device."""
    if torch.device(config.device).type != "cuda":
        return config.device
    return f"cuda:{os.environ.get('LOCAL_RANK', rank % ranks_per_node)}"


def _threads_per_rank(config: EngineConfig, ranks_here: int) -> int:
    return max(1, (config.parallel.num_threads or default_num_threads()) // ranks_here)


def _spawn(config: EngineConfig, ranks: range, init_method: str, ranks_here: int) -> list[multiprocessing.Process]:
    context = multiprocessing.get_context("spawn")
    processes = []
    for rank in ranks:
        process = context.Process(
            target=worker_main,
            args=(config, rank, init_method, ranks_here, os.getpid()),
            name=f"tokenriver-tp-rank{rank}",
            daemon=True,
        )
        process.start()
        processes.append(process)
    return processes


def _local_kv_cache(
    config: EngineConfig, loaded: LoadedModel, layout: ShardLayout, num_blocks: int, device: str
) -> KVCache:
    model_config = loaded.config
    return KVCache(
        model_config.num_layers,
        num_blocks,
        config.cache.block_size,
        layout.num_kv_heads,
        model_config.head_dim,
        getattr(torch, config.resolved_kv_cache_dtype),
        device,
    )


def start_tensor_parallel(
    config: EngineConfig, loaded: LoadedModel, num_blocks: int
) -> tuple[KVCache, TensorParallelRunner]:
    """Rank 0: start the other ranks of this machine, join the group, shard `loaded.model` in place, and return
    this rank's KV cache (its kv heads, every block) and the runner that broadcasts each step's plan."""
    where = placement(config)
    if where.local_ranks.start != 0:
        raise InvalidParameterError(
            f"node_rank={config.parallel.node_rank} hosts no engine: run it with the same flags "
            f"through the CLI, which starts only its ranks",
            param="node_rank",
        )
    processes = (
        [] if where.launched else _spawn(config, where.local_ranks[1:], where.init_method, len(where.local_ranks))
    )
    group = TensorParallelGroup.connect(0, config.parallel.tensor_parallel_size, where.init_method, config.device)
    torch.set_num_threads(_threads_per_rank(config, len(where.local_ranks)))
    layout = shard_model(loaded.model, group)
    group.broadcast(num_blocks)
    kv_cache = _local_kv_cache(config, loaded, layout, num_blocks, config.device)
    runner = TensorParallelRunner(ModelRunner(loaded.model, kv_cache, config.device, config.seed), group, processes)
    atexit.register(_close_quietly, runner)
    return kv_cache, runner


def _close_quietly(runner: TensorParallelRunner) -> None:
    """At interpreter exit: stop the other ranks if they still listen; a rank already gone is no error then."""
    with contextlib.suppress(Exception):
        runner.close()


def worker_main(
    config: EngineConfig, rank: int, init_method: str, ranks_here: int, parent_pid: int | None = None
) -> None:
    """A rank other than 0, in its own process: load, join, shard, then run rank 0's plans until told to stop.

    parent_pid: the process that spawned this one, whose end this rank does not outlive (_exit_with_parent)."""
    if parent_pid is not None:
        _exit_with_parent(parent_pid)
    device = _rank_device(config, rank, ranks_here)
    torch.set_num_threads(_threads_per_rank(config, ranks_here))
    loaded = load_model(
        config.model,
        config.resolved_dtype,
        device,
        config.numerics.quantization,
        int8_activations=config.resolved_int8_activations,
        kquant_layout=False,  # the layouts shard_model cuts, as rank 0 loads them (engine/core.py)
    )
    group = TensorParallelGroup.connect(rank, config.parallel.tensor_parallel_size, init_method, device)
    try:
        layout = shard_model(loaded.model, group)
        num_blocks = group.broadcast()
        kv_cache = _local_kv_cache(config, loaded, layout, num_blocks, device)
        serve_steps(ModelRunner(loaded.model, kv_cache, device, config.seed), group)
    finally:
        group.close()


def _exit_with_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """End this process once parent_pid, the one that spawned it, is gone. A killed engine (SIGKILL, a crash) runs
    no exit handler to stop its ranks, and a rank joining the group or waiting for a plan would wait for it until
    the rendezvous times out, or forever, holding its memory and threads. The parent's end shows as another
    parent id (the orphan is adopted), even if it came before this process got this far."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="tokenriver-tp-parent-watch", daemon=True).start()


def run_worker_node(config: EngineConfig) -> int | None:
    """For the CLI: on a machine or process that hosts no rank 0, run its ranks until the engine stops and return
    an exit code; None where this process should start the engine itself."""
    where = placement(config)
    if where.local_ranks.start == 0:
        return None
    if where.launched:
        worker_main(config, where.local_ranks.start, where.init_method, 1)
        return 0
    first = where.local_ranks.start
    processes = _spawn(config, where.local_ranks[1:], where.init_method, len(where.local_ranks))
    worker_main(config, first, where.init_method, len(where.local_ranks))
    for process in processes:
        process.join()
    return 0
