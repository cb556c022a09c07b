"""A run's state in memory, for a replica that heals from a live peer (fault tolerance): exactly what a checkpoint
holds (`run_state`'s one list), captured on the live replica and restored on the healing one, rank by rank.
"""

from __future__ import annotations

from typing import Any

import torch

from accel.checkpoint import tree
from accel.checkpoint.rng_states import _apply_rng, rng_snapshot, rng_state
from accel.checkpoint.run_state import TrainingObjects, _collect, _copied_if_changed_before_the_step, _hand_over


# -- the state in memory: a replica heals from a live one (fault tolerance) --------------------------------------

def _local(value: Any) -> Any:
    """A tensor as this rank holds it (a DTensor's local shard), detached: what crosses to the same rank elsewhere."""
    if not isinstance(value, torch.Tensor):
        return value
    return (value.to_local() if hasattr(value, "to_local") else value).detach()


def _live_tensors(objects: TrainingObjects) -> dict:
    tensors: dict = {}
    tree.split(_collect(objects, [objects.backend.checkpoint_model_state(m) for m in objects.models]), "", tensors)
    return tensors


def capture_state(objects: TrainingObjects) -> dict:
    """This rank's whole training state, in memory: exactly what save_state writes (the same `_collect`, without the
    save pre-hooks: nothing is written) and this rank's RNG states, each tensor as this rank's shard. What a live
    replica sends to the same rank of a replica that heals (`restore_state` there), so a heal carries what a
    checkpoint would: a part added to checkpoints is healed too."""
    tensors: dict = {}
    skeleton = tree.split(_collect(objects, [objects.backend.checkpoint_model_state(m) for m in objects.models]),
                          "", tensors)
    # the peer may read them while this replica's next forward runs: what changes before the step is copied now, as
    # for an asynchronous save (batch norm's statistics, schedulers', loaders' and registered objects' tensors)
    tensors = _copied_if_changed_before_the_step({k: _local(v) for k, v in tensors.items()}, objects.models)
    return {"skeleton": skeleton, "tensors": tensors, "rng": rng_snapshot()}


def restore_state(objects: TrainingObjects, received: dict, source: str, in_flight: tuple = ()) -> None:
    """Load what `capture_state` gave on the same rank of a replica with the same layout: each shard goes back into a
    tensor of this rank's live layout (a DTensor's mesh and placements), then the objects take the state as they do
    from a checkpoint (`_hand_over`), and the RNG states last. A part that does not fit raises CheckpointError naming
    `source`."""
    live = _live_tensors(objects)
    tensors = {k: _like(live.get(k), v) for k, v in received["tensors"].items()}
    _hand_over(tree.join(received["skeleton"], tensors), objects.models, objects, source, in_flight)
    _apply_rng(rng_state(*received["rng"]))


def _like(live: Any, value: Any) -> Any:
    """`value` (a received shard) as a tensor laid out like `live` (this rank's tensor of the same name)."""
    if not isinstance(value, torch.Tensor) or not isinstance(live, torch.Tensor):
        return value
    from torch.distributed.tensor import DTensor

    if isinstance(live, DTensor):
        local = live.to_local()
        return DTensor.from_local(value.to(local.device, local.dtype), live.device_mesh, live.placements,
                                  run_check=False, shape=live.shape, stride=live.stride())
    return value.to(live.device)
