"""Tensor parallelism on torch.distributed: the process group and its collectives (group.py), and how a loaded
model's layers are cut into per-rank shards (sharding.py).

The runner sits above this package (runner/tensor_parallel.py sends each step's plan from rank 0 to the others);
the engine starts the ranks (engine/tensor_parallel.py). Nothing here knows about requests or schedulers.
"""
