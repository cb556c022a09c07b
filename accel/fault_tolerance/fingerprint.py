"""Replica groups that hold different weights are caught, not trained on: a cheap fingerprint of each parameter,
compared over the live groups every `check_every` committed steps and at the end.

A parameter's fingerprint is the sum of its bits (each element read as an integer of its own width), folded below
2**31 so that it is exact in float64: any change of one element changes it. The groups compare them with two
all-reduces of one small vector (MAX of the fingerprints and of their negatives: every group sees the same maximum
and minimum, so every group decides alike); only on a difference does a third say which group holds what. Under
HSDP each rank compares its own shards with the same rank of the other groups, and the ranks of a group agree before
anyone stops, so the whole job stops at the same step.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from accel.fault_tolerance import REPLICAS_DIVERGED_EXIT_CODE as EXIT_CODE

FOLD = 2**31 - 1  # a prime below 2**31: fingerprints stay exact in float64 after a sum of their bits


class ReplicasDiverged(SystemExit):
    """The job stops (exit code 76) with one line; a SystemExit, so no traceback and no `except Exception` keeps a
    loop going on diverged replicas."""


_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bit_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of `tensor`'s bits, element by element, as an int64 tensor on its device (this rank's shard of a
    DTensor); summed in int64 without a copy, exact below 2**32 elements."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    local = local.detach()
    if local.numel() == 0 or local.device.type == "meta":
        return torch.zeros((), dtype=torch.int64)
    if local.dtype == torch.bool:
        local = local.to(torch.uint8)
    bits = local.contiguous().view(_INTEGER[local.element_size()]) if local.is_floating_point() or \
        local.is_complex() else local
    return bits.sum(dtype=torch.int64)


def tensor_fingerprint(tensor: torch.Tensor) -> int:
    """One tensor's fingerprint: its bit sum folded below 2**31."""
    return int(_bit_sum(tensor)) % FOLD


def fingerprints(models: list) -> tuple[list[str], torch.Tensor]:
    """(names, float64 fingerprints on the CPU) of the prepared models' parameters, in order ('model i: name'); one
    transfer from the device for all of them."""
    names, sums = [], []
    for i, model in enumerate(models):
        for name, param in model.named_parameters():
            names.append(f"model {i}: {name}" if len(models) > 1 else name)
            sums.append(_bit_sum(param))
    if not sums:
        return names, torch.zeros(0, dtype=torch.float64)
    device = sums[0].device
    folded = torch.stack([s.to(device) for s in sums]).remainder(FOLD)
    return names, folded.cpu().to(torch.float64)


def _over_groups(manager, tensor: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """MAX of `tensor` over the live replica groups (torchft's all-reduce); None when it failed (a group died: the
    next check compares again)."""
    buffer = tensor.to(device)
    manager.allreduce(buffer, reduce_op=ReduceOp.MAX).wait()
    return None if manager.errored() is not None else buffer.cpu()


def difference(manager, models: list, replica_id: int, device: torch.device) -> str | None:
    """None when every live group holds this rank's parameters bit for bit alike; else what differs, in words."""
    if manager.num_participants() < 2 or not manager.is_participating():
        return None
    names, values = fingerprints(models)
    if not names:
        return None
    extremes = _over_groups(manager, torch.cat([values, -values]), device)
    if extremes is None:
        return None
    n = len(names)
    differs = (extremes[:n] != -extremes[n:]).nonzero()
    if differs.numel() == 0:
        return None
    first = int(differs[0])
    rank, size = manager.participating_rank(), manager.num_participants()
    who = torch.zeros(2 * size, dtype=torch.float64)  # (replica id + 1, fingerprint) in this group's slots
    who[rank], who[size + rank] = replica_id + 1, values[first]
    seen = _over_groups(manager, who, device)
    held = ", ".join(f"group {int(seen[r]) - 1}: {int(seen[size + r])}" for r in range(size)) if seen is not None \
        else "the groups' values were not received"
    return f"{names[first]} (fingerprint {held})"


def agree_in_group(found: str | None, device: torch.device) -> str | None:
    """A difference any rank of this group found, the same on every rank (the group's process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return found
    flag = torch.tensor([1.0 if found else 0.0], device=device)
    dist.all_reduce(flag, op=ReduceOp.MAX)
    if not flag.item():
        return None
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    rank = next(r for r, text in enumerate(everyone) if text)
    return everyone[rank] + (f" (rank {rank} of each group)" if dist.get_world_size() > 1 else "")


def stop(where: str, step: int, every: int) -> None:
    """Stop this process with the one line (every process of every group reaches this at the same step)."""
    line = (f"accel: error: fault tolerance: the replica groups hold different weights after committed step {step}: "
            f"{where}; stopped rather than trained on (a heal that missed part of the state, or per-group "
            f"nondeterminism; checked every {every} steps, fault_tolerance.check_every)")
    if not dist.is_initialized() or dist.get_rank() == 0:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    raise ReplicasDiverged(EXIT_CODE)
