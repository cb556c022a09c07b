"""A one-rank `DeviceMesh` for FSDP2 on one process (ZeRO 2/3 with FSDP2's mixed-precision policy, as Accelerate
runs one GPU process): FSDP2 needs a process group even where it has nothing to exchange. Without one, a default
group of one rank is made over an in-process store (no address or port to agree on), owned by the process state,
which destroys it at exit like the group of a multi-process run (`PartialState.init_one_rank_group`)."""

from __future__ import annotations

import torch.distributed as dist


def one_rank_mesh(state):
    """A 1-D mesh named `dp` over this process alone (the default group, made here when there is none)."""
    from torch.distributed.device_mesh import init_device_mesh

    device_type = state.device.type
    if not dist.is_initialized():
        # a GPU's CPU tensors (offload, a clipped norm of offloaded shards) take the gloo side
        backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
        state.init_one_rank_group(backend)
    elif dist.get_world_size() != 1:
        raise RuntimeError(f"a one-rank mesh asked for, but the default process group has {dist.get_world_size()} "
                           "ranks")
    return init_device_mesh(device_type, (1,), mesh_dim_names=("dp",))
