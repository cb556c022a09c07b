"""The trivial script bench_launch.py starts: join a gloo group when launched on several processes, then leave.

The same file is run by every launcher compared (accel launch, torchrun, python), so only the launchers differ.
"""

import os

import torch.distributed as dist

if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
