"""The recipe: every model transformation accel applies, as plain functions called in one fixed order by
`parallelize` (torchtitan's `parallelize_*` is the model):

    1. place on the device            (skipped for CPU offload and meta-device models)
    2. materialize                    (a meta-device model that will not be sharded: allocate it whole)
    3. float8 conversion              (mixed_precision fp8: torchao's Float8Linear; a warning without compile)
    4. the parts' steps, in order     (each parallel dimension's `transform`, e.g. tensor parallelism: DTensor
                                      over its sub-mesh; accel/parallel/)
    5. activation checkpointing       (each repeated block recomputed in backward)
    6. regional compilation           (torch.compile of each repeated block)
    7. data parallelism over `dp`:    FSDP2 (the data-parallel plan's fsdp/hsdp kinds: HSDP over the 2-D
                                      dp_replicate x dp_shard mesh; the parts shard their own modules first)
                                      with FSDP2's MixedPrecisionPolicy where the plan says so, then
                                      materialize a meta-device model's shards; or DDP (ddp/zero1)
    8. whole-model compilation        (torch.compile of the wrapped model, as Accelerate does)

Why this order: float8 must see plain `nn.Linear` before a split replaces their weights with DTensors; the parts
split before FSDP shards (FSDP2 shards the local shards over `dp`); checkpointing and compilation wrap the blocks
that FSDP then shards, so FSDP's gathers stay outside the recomputed and compiled regions. The pipeline
backend cuts the model into stages and runs this same recipe on each stage.

A new transformation is one function here (or in accel/transforms/) and one field of `Recipe`; a new parallel
dimension is a part (accel/parallel/part.py), not a field.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from accel.parallel.data_parallel import DataParallelPlan
from accel.parallel.part import Part
from accel.transforms.activation_checkpointing import apply_activation_checkpointing, disable_kv_cache
from accel.transforms.blocks import repeated_blocks
from accel.transforms.compilation import compile_blocks


@dataclasses.dataclass
class Recipe:
    """What `parallelize` does to one model, decided by the backend from the config and the topology."""

    parallelism: Any  # the ParallelismConfig (activation_checkpointing, wrap classes)
    precision: Any  # the PrecisionPolicy (FSDP's mixed-precision policy, float8)
    device: torch.device
    device_placement: bool = True
    float8_layers: set[str] | None = None  # chosen on the whole model (pipelines); None: on this model
    data_parallel: DataParallelPlan = dataclasses.field(default_factory=DataParallelPlan)  # the kind, offload
    dp_mesh: Any = None  # FSDP2's mesh: 1-D, or 2-D (dp_replicate, dp_shard) for HSDP (None: the default group)
    wrap_ddp: Callable[[torch.nn.Module], torch.nn.Module] | None = None  # the backend's DDP (options, group)
    compile: dict | None = None  # torch.compile's keyword arguments plus "regional"; None: eager
    parts: Iterable[Part] = ()  # the parallel dimensions, whose steps run in order (step 4, and FSDP2's first)
    kept_whole: set[str] = dataclasses.field(default_factory=set)  # module names a part keeps whole on every rank of
    # the other dimensions (noted at its prepare, honoured by the parts that split modules)


def parallelize(model: torch.nn.Module, recipe: Recipe) -> torch.nn.Module:
    """Apply the recipe's steps to `model` in the documented order; return the model to train (DDP wraps it)."""
    on_meta = any(p.is_meta for p in model.parameters())
    data_parallel = recipe.data_parallel
    if recipe.device_placement and not on_meta and not data_parallel.offload:
        model = model.to(recipe.device)
    if on_meta and not data_parallel.fsdp:
        materialize(model, recipe.device)
    if recipe.precision.float8 is not None:
        from accel.runtime.float8 import convert_to_float8, warn_without_compile

        convert_to_float8(model, recipe.precision.float8, data_parallel.fsdp, recipe.float8_layers)
        warn_without_compile(recipe.compile is not None)
    for part in recipe.parts:
        part.transform(model, recipe)
    apply_activation_checkpointing(model, recipe.parallelism)
    options = dict(recipe.compile or {})
    regional = options.pop("regional", False)
    if recipe.compile is not None:
        disable_kv_cache(model)  # a KV cache's per-layer state would make every compiled block recompile
    if recipe.compile is not None and regional:
        compile_blocks(model, recipe.parallelism, options)
    if data_parallel.fsdp:
        mp_policy = recipe.precision.fsdp_policy() if data_parallel.low_precision_params else None
        apply_fsdp(model, recipe.dp_mesh, recipe.parallelism, mp_policy,
                   reshard_after_forward=data_parallel.reshard_after_forward, offload=data_parallel.offload,
                   pin_memory=recipe.device.type == "cuda", parts=recipe.parts)
        if on_meta:  # offload: the parameters' shards on the CPU (FSDP2 moves them to the device for compute),
            # the buffers on the device, where forward uses them and FSDP2 never moves them
            materialize(model, "cpu" if data_parallel.offload else recipe.device, buffers_device=recipe.device)
    elif data_parallel.ddp:
        if recipe.wrap_ddp is None:
            raise ValueError("Recipe: data_parallel 'ddp' needs wrap_ddp (the backend's DDP with its options)")
        model = recipe.wrap_ddp(model)
    if recipe.compile is not None and not regional:
        model.compile(**options)  # in place: names, state dicts and the wrapper type stay the user's
    return model


def apply_fsdp(model: torch.nn.Module, mesh, parallelism, mp_policy=None, reshard_after_forward: bool = False,
               offload: bool = False, pin_memory: bool = False, parts: Iterable[Part] = ()) -> None:
    """FSDP2 (`fully_shard`) over `mesh`: each repeated block (inner before outer), then the root. Parameters
    are resharded after forward with `reshard_after_forward` (ZeRO-3); `mp_policy`: FSDP2's MixedPrecisionPolicy
    (compute-dtype parameters, fp32 reduction), None: the parameters' own dtype. A 2-D mesh is HSDP: parameters
    are sharded over its inner (dp_shard) dimension and replicated over the outer one, whose replicas all-reduce
    the reduce-scattered gradients (fully_shard does both from the mesh). Each of `parts` first shards its own
    modules on meshes of its own (given the same options, without the mesh)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    if offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_memory)
    for part in parts:
        part.shard_first(model, {k: v for k, v in options.items() if k != "mesh"})
    for block in reversed(repeated_blocks(model, parallelism)):  # inner blocks before their parents
        if not isinstance(block, FSDPModule):  # a part made it a unit of its own
            fully_shard(block, **options)
    fully_shard(model, **options)


@contextlib.contextmanager
def fsdp_no_sync(model):
    """FSDP2's `no_sync`: gradients accumulate locally until the context ends."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def materialize(model: torch.nn.Module, device, buffers_device=None) -> None:
    """Allocate a meta-device model's (local shards of) parameters and initialise them with each
    submodule's `reset_parameters()`: a model larger than one process can be created this way. `buffers_device`:
    where the buffers go when it differs from the parameters' (CPU offload: the parameters stay on the CPU, the
    buffers, BatchNorm statistics or index tables used in forward, belong with the compute on the device)."""
    model.to_empty(device=device)
    if buffers_device is not None and torch.device(buffers_device) != torch.device(device):
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(buffers_device)
    with torch.no_grad():
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if reset is not None:
                reset()
