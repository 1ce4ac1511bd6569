"""Tensor parallelism on torch.distributed, all of it here: the process group and its collectives (group.py), how a
loaded model's layers are cut into per-rank shards (sharding.py), rank 0's runner that sends each step's plan to the
other ranks and the loop they serve it in (runner.py), and how the ranks' processes start (launch.py).

It sits above the runner and the loader, whose ModelRunner and loaded model each rank runs, and below the engine,
which starts it. Nothing here knows about requests or schedulers beyond the plain SchedulerOutput it broadcasts.
"""
