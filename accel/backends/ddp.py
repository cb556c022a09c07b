"""Data parallelism with `torch.nn.parallel.DistributedDataParallel`, the recipe's last step when parameters stay
whole (zero_stage 0 or 1): gradients are all-reduced in buckets during backward (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from accel.config.kwargs import DistributedDataParallelKwargs
from accel.parallel.gradients import sum_gradients


def apply_ddp(model: torch.nn.Module, group, device: torch.device,
              handler: DistributedDataParallelKwargs | None = None) -> torch.nn.Module:
    """`model` in DDP over `group` with the options of the user's `DistributedDataParallelKwargs` (and its
    communication hook); a model with nothing to train (e.g. a frozen evaluation model) is returned as is, since
    DDP refuses it."""
    if not any(p.requires_grad for p in model.parameters()):
        return model
    options = (handler or DistributedDataParallelKwargs()).to_kwargs()
    comm_hook, comm_state = options.pop("comm_hook", None), options.pop("comm_state", None)
    wrapper, state_options = options.pop("comm_wrapper", None), options.pop("comm_state_option", {})
    device_ids = [device.index] if device.type == "cuda" else None
    wrapped = DDP(model, device_ids=device_ids, process_group=group, **options)
    fix_bucket_layout(wrapped)  # before a hook is registered: its state (PowerSGD's) sees only real steps
    if comm_hook is not None and not callable(comm_hook):  # Accelerate's DDPCommunicationHookType
        comm_hook, comm_state = named_comm_hook(comm_hook, wrapper, state_options, group)
    if comm_hook is not None:
        wrapped.register_comm_hook(comm_state, comm_hook)
    return wrapped


def fix_bucket_layout(ddp: DDP) -> None:
    """Give DDP its final gradient buckets now, the same in every process and at every step.

    torch reduces a process's first backward in one bucket of all gradients in parameter order, then rebuilds the
    buckets in the order that backward produced the gradients, and keeps those. An all-reduce over 3 or more ranks
    adds each element's values in an order that depends on where the element lies in its bucket, so the first step
    a process runs is rounded differently from the same step in a process that ran steps before it: a run resumed
    with `load_state` drifted from the uninterrupted one (dp 2 x sp 2 on 4 processes: 6e-08 in the weights after
    4 steps; on 2 ranks a + b = b + a, so it did not show). Here the reducer's own hook is fired for every
    parameter, in reverse parameter order (the order in which a backward mostly produces them, as torch's
    bucketing assumes), inside a backward of nothing but zeros (one all-reduce of zeros, every rank at prepare),
    and the buckets are rebuilt from that order with torch's size limits; torch rebuilds them only once, so they
    stay. No user hook runs and no gradient is left behind.

    With `find_unused_parameters` (and no static graph) torch never rebuilds: nothing to do. With `static_graph`
    torch's reducer keeps counts of its own first iterations, which this backward before them broke (wrong
    gradients from the second step on, measured): torch rebuilds then, after the second backward, and a resume on
    3 or more ranks is not bit-exact (1.2e-07 after 4 steps on 4 processes)."""
    reducer = getattr(ddp, "reducer", None)
    internals = (hasattr(reducer, "_autograd_hook") and hasattr(reducer, "_rebuild_buckets")
                 and hasattr(ddp, "_build_params_for_reducer"))  # torch's private API: another torch keeps its own
    if reducer is None or not internals or ddp.find_unused_parameters or ddp.static_graph \
            or getattr(ddp, "mixed_precision", None) is not None:  # DDP's own mixed precision fires hooks itself
        return
    params, _ = ddp._build_params_for_reducer()
    if not params:
        return
    grads = [p.grad for p in params]

    def fire(_grad):
        for index in reversed(range(len(params))):
            reducer._autograd_hook(index)  # the reducer's hook for params[index]: its gradient is ready

    with torch.enable_grad():  # prepare may be called under no_grad
        leaf = torch.zeros((), device=params[0].device, requires_grad=True)
        leaf.register_hook(fire)
        reducer.prepare_for_backward([])  # armed, as a synced forward arms it
        (leaf * 1).backward()  # the reducer finalizes (all-reduces the zeros) at the end of this backward
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad  # the zeros the reduction wrote go; None stays None
    if reducer._rebuild_buckets():
        ddp._has_rebuilt_buckets = True


def named_comm_hook(name, wrapper, state_options: dict, group):
    """(hook, state) for Accelerate's hook names: torch's fp16/bf16 compression or (batched) PowerSGD, optionally
    wrapped to send in fp16/bf16; None for `no`.

    Two torch limits are lifted, with torch's own hook code: DDP refuses to register a bf16 hook unless CUDA+NCCL
    >= 2.10 (or XPU) is there, although gloo all-reduces bfloat16 correctly, so on gloo the hook is registered
    under another `__name__`; and `batched_powerSGD_hook` fails at its first compressed step in torch releases
    whose `_orthogonalize` takes only 3-D batches, so it then runs with an `_orthogonalize` that also takes its
    2-D matrix (`_batched_power_sgd`)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    name, wrapper = str(getattr(name, "value", name)).lower(), str(getattr(wrapper, "value", wrapper) or "no").lower()
    hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook,
             "power_sgd": powerSGD_hook.powerSGD_hook, "batched_power_sgd": _batched_power_sgd()}
    wrappers = {"fp16": default_hooks.fp16_compress_wrapper, "bf16": default_hooks.bf16_compress_wrapper}
    if name == "no":
        return None, None
    if name not in hooks or (wrapper != "no" and wrapper not in wrappers):
        raise ValueError(f"DistributedDataParallelKwargs: comm_hook {name!r} / comm_wrapper {wrapper!r}; allowed: "
                         f"comm_hook one of no, {', '.join(hooks)}; comm_wrapper no, fp16 or bf16")
    hook = hooks[name]
    state = group
    if "power_sgd" in name:
        state = powerSGD_hook.PowerSGDState(process_group=group, **state_options)
    if wrapper != "no":
        hook = wrappers[wrapper](hook)
    if "bf16" in (name, wrapper) and torch.distributed.get_backend(group) == "gloo":
        hook = _renamed(hook)
    return hook, state


def _renamed(hook):
    """`hook` under a `__name__` that DDP's NCCL-version check for bf16 hooks does not match (its logged
    `__qualname__` stays torch's)."""

    def gloo_bf16_hook(state, bucket):
        return hook(state, bucket)

    gloo_bf16_hook.__qualname__ = hook.__qualname__
    return gloo_bf16_hook


def _batched_power_sgd():
    """torch's `batched_powerSGD_hook`; where its `_orthogonalize` refuses the hook's 2-D matrix (batched by
    pytorch#75157, it raises on 2-D), the same code with an `_orthogonalize` that takes 2-D as a batch of one."""
    import types

    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as module

    hook = module.batched_powerSGD_hook
    try:
        module._orthogonalize(torch.ones(2, 1))
    except Exception:  # noqa: BLE001 - AssertionError today; any refusal means the same
        batched = module._orthogonalize
    else:
        return hook

    def _orthogonalize(matrices, epsilon=0):
        return batched(matrices[None] if matrices.dim() == 2 else matrices, epsilon)

    scope = {**vars(module), "_orthogonalize": _orthogonalize}
    fixed = types.FunctionType(hook.__code__, scope, hook.__name__, hook.__defaults__, hook.__closure__)
    fixed.__qualname__, fixed.__doc__ = hook.__qualname__, hook.__doc__
    return fixed


@contextlib.contextmanager
def ddp_pipeline_stages(stages: list, skip_sync: bool, split_backward: bool = False):
    """How pipeline stages (`PipelineStage`) whose module is in DDP run a training step.

    With `skip_sync` (inside `accumulate`): on the modules inside their DDP wrappers, so there is no gradient
    reduction and gradients accumulate locally (DDP's `no_sync`; PipelineStage would otherwise reduce after the
    last micro-batch). The next step that goes through DDP reduces the accumulated gradients.

    Otherwise: inside DDP's `no_sync`, where only the last micro-batch's backward reduces, as PipelineStage
    arranges it. Its shape-inference forward on the first step then does not arm DDP's reducer either (armed,
    the reducer counted that pass and the real one as one backward and failed its bucket rebuild with
    "rebuilt parameter indices size is not same as original model parameters size" when
    pp_microbatches == pp_size).

    `split_backward` (the zero-bubble schedules): torch computes their weight gradients with `autograd.grad` and adds
    them to `.grad` itself, past DDP's hooks, so DDP would never reduce them. The stages then run on the modules
    inside DDP, and at the end of a step that syncs, each stage's gradients (the window's, accumulated) are averaged
    over its DDP group here, as DDP would have."""
    ddp = [(stage, stage.submod) for stage in stages if isinstance(stage.submod, DDP)]
    with contextlib.ExitStack() as stack:
        for stage, module in ddp:
            if skip_sync or split_backward:
                stage.submod = module.module
            else:
                stack.enter_context(module.no_sync())
        try:
            yield
        finally:
            for stage, module in ddp:
                stage.submod = module
    if split_backward and not skip_sync:  # the same parameters have gradients on every replica: the same stage ran
        for _, module in ddp:
            grads = [p.grad for p in module.module.parameters() if p.grad is not None]
            sum_gradients(grads, module.process_group, divide_by=dist.get_world_size(module.process_group))


def release_ddp(modules: list) -> None:
    """Drop each live DDP module's reducer and logger (C++ objects that hold the process group).

    The user's script still holds the DDP module at interpreter exit; its reducer must go before the
    group does, or a rank can abort ("terminate called without an active exception").
    """
    for module in modules:
        if module is not None:
            for attr in ("logger", "reducer"):
                if attr in module.__dict__:
                    module.__dict__[attr] = None
