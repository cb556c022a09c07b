"""Accelerate's `accelerate.utils.launch` helper for launching a function in several processes."""

from __future__ import annotations

import os
from typing import Callable

from accel.state import DistributedType


class PrepareForLaunch:
    """`launcher` made ready to run as process `index` of a forked job (what `torch.multiprocessing.start_processes`
    calls): it sets LOCAL_RANK and RANK (`NPROC * NODE_RANK + index`) for a multi-process distributed type, or, with
    `debug`, joins a gloo group through the file store $ACCELERATE_DEBUG_RDV_FILE; FORK_LAUNCHED=1 in every case."""

    def __init__(self, launcher: Callable, distributed_type="NO", debug: bool = False):
        self.launcher = launcher
        self.distributed_type = DistributedType(distributed_type)
        self.debug = debug

    def __call__(self, index: int, *args):
        if self.debug:
            import torch.distributed as dist

            world_size = int(os.environ.get("WORLD_SIZE"))
            store = dist.FileStore(os.environ.get("ACCELERATE_DEBUG_RDV_FILE"), world_size)
            dist.init_process_group("gloo", rank=index, store=store, world_size=world_size)
        elif self.distributed_type in (DistributedType.MULTI_GPU, DistributedType.MULTI_MLU,
                                       DistributedType.MULTI_MUSA, DistributedType.MULTI_NPU,
                                       DistributedType.MULTI_XPU, DistributedType.MULTI_CPU,
                                       DistributedType.MULTI_NEURON):
            os.environ["LOCAL_RANK"] = str(index)
            processes_per_node = int(os.environ.get("NPROC", 1))
            os.environ["RANK"] = str(processes_per_node * int(os.environ.get("NODE_RANK", 0)) + index)
        os.environ["FORK_LAUNCHED"] = str(1)
        self.launcher(*args)
