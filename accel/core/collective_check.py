"""A CPU run that sees the collectives NCCL would refuse: the collective-device check (ACCEL_CHECK_COLLECTIVE_DEVICES).

gloo takes a CPU tensor in any collective; NCCL takes only CUDA tensors, unless the group has a CPU backend too
(`"cuda:nccl,cpu:gloo"`). On a CPU run every tensor is a CPU tensor, so a collective that would send a host tensor
on a GPU job (an offloaded gradient's norm, a flag made with `torch.tensor(...)`, a fallback to `torch.device("cpu")`)
cannot fail there. With `ACCEL_CHECK_COLLECTIVE_DEVICES=cuda` (the multi-process tests set it) a job run on the CPU
pretends to be a CUDA job with two devices that are both the CPU:

- the accelerator is `torch.device("cpu", 0)` (`state.device`), and tensors on it report that device;
- the host is `torch.device("cpu")`: a tensor made with no device (torch's default device, the CPU on a GPU job too),
  with an explicit `"cpu"`, by `.cpu()`, `.to("cpu")` or `.pin_memory()`, and every result computed from host tensors
  only, is a host tensor (a torch function mode follows them, by their storage; `.to()` between the two copies, as
  it would on a GPU).

Every collective (torch.distributed's functions and the functional collectives DTensor and FSDP2 use) is checked:
a host tensor sent over a group whose backend would have no CPU backend on the GPU job raises NCCL's error with the
call site, so the multi-process tests fail where a GPU job would. The backend a GPU job's groups would have is
`PartialState`'s choice (`process_group_backend`); a group accel makes for the CPU (`new_group(backend="gloo")`)
is registered with `note_cpu_group`. Object collectives move their own bytes to the group's device and are not
checked inside. Off unless the variable is set; never on in a real GPU job.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

# what a torch function's arguments hold besides tensors and containers: never searched for tensors
_SCALARS = (int, float, bool, complex, str, bytes, type(None), slice, type(Ellipsis), torch.dtype, torch.device,
            torch.layout, torch.memory_format, torch.Size)
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors that are their own storage's owner (not a DTensor's wrapper)

ENV = "ACCEL_CHECK_COLLECTIVE_DEVICES"
ACCELERATOR = torch.device("cpu", 0)  # the pretended accelerator
HOST = torch.device("cpu")

_cpu_groups: weakref.WeakSet = weakref.WeakSet()  # groups with a CPU backend on the GPU job
_state: dict[str, Any] = {"active": False, "default_has_cpu": False, "inside_object_collective": 0}

_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
                "reduce", "gather", "scatter", "batch_isend_irecv")
_FUNCTIONAL = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")  # the ops' name prefixes
_OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                       "send_object_list", "recv_object_list", "barrier", "monitored_barrier")
_GETTER = torch.Tensor.device.__get__  # a method-wrapper: compared with ==, not `is`


def requested() -> bool:
    """The variable asks for the check (a CUDA job pretended on the CPU); another value is refused in one line."""
    value = os.environ.get(ENV, "").strip().lower()
    if value not in ("", "cuda"):
        raise ValueError(f"environment variable {ENV}={os.environ[ENV]!r}; allowed: cuda (check as a CUDA job) or "
                         "unset")
    return value == "cuda"


def active() -> bool:
    return bool(_state["active"])


# -- which tensors are on the host ------------------------------------------------------------------------------
def _tensors(value: Any, found: list) -> list:
    """The tensors in `value`, added to `found` (`_iter_tensors`)."""
    found.extend(_iter_tensors(value))
    return found


def _iter_tensors(value: Any):
    """The tensors in `value`, one at a time, so that a search can stop early: tuples, lists and dicts walked here,
    their tensors and scalars without a call each, any other container by pytree (the mode walks arguments and
    results of torch functions, where pytree's generic walk would cost more than the rest)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, _SCALARS):
        return
    elif isinstance(value, (tuple, list, dict)):
        for item in value.values() if isinstance(value, dict) else value:
            if isinstance(item, torch.Tensor):
                yield item
            elif not isinstance(item, _SCALARS):
                yield from _iter_tensors(item)
    else:
        yield from (t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


def _inputs_kind(args: tuple, kwargs: dict) -> str | None:
    """'accelerator' when any tensor argument is the accelerator's (found at the first), 'host' when all are host
    tensors, None when there is none."""
    if args and isinstance(args[0], torch.Tensor) and not is_host(args[0]):  # the usual call: said at once
        return "accelerator"
    found = False
    for value in (args, kwargs):
        for t in _iter_tensors(value):
            if not is_host(t):
                return "accelerator"
            found = True
    return "host" if found else None


def _local(t: torch.Tensor) -> torch.Tensor:
    if type(t) in _PLAIN:
        return t
    local = getattr(t, "_local_tensor", None)  # a DTensor: its shard is what a collective sends
    return local if isinstance(local, torch.Tensor) else t


def _storage(t: torch.Tensor) -> Any:
    try:
        return _local(t).untyped_storage()  # one Python object per storage, kept while the storage lives
    except (RuntimeError, NotImplementedError, TypeError):  # no storage (a subclass, meta): never a host tensor
        return None


def is_host(t: torch.Tensor) -> bool:
    return bool(getattr(_storage(t), "_accel_host", False))


def _mark(t: torch.Tensor, host: bool) -> None:
    """Tag `t`'s storage (its views share it): the tag lives and dies with the storage, never with an address."""
    storage = _storage(t)
    if storage is not None:
        try:
            storage._accel_host = host
        except AttributeError:
            pass


def _kind(device: Any, depth: int = 2) -> str | None:
    """'host', 'accelerator' or None (not named) for a device argument. torch.distributed's own code names a mesh's
    device by its type, the string "cpu" here ("cuda" on the GPU job): the accelerator, when it comes from there."""
    if device is None:
        return None
    if isinstance(device, int):
        return "accelerator"
    if isinstance(device, str) and device == "cpu":
        frame: Any = sys._getframe(depth)
        while frame is not None and frame.f_globals.get("__name__", "") in ("torch.overrides", __name__):
            frame = frame.f_back
        if frame is not None and frame.f_globals.get("__name__", "").startswith("torch.distributed"):
            return "accelerator"
    device = torch.device(device)
    if device.type != "cpu":
        return "accelerator"
    return "accelerator" if device.index is not None else "host"


def _target_of_to(args: tuple, kwargs: dict) -> Any:
    other: Any = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else kwargs.get("other")
    if isinstance(other, torch.Tensor):  # `.to(other)`: to where the other tensor is (torch reads its real device)
        return HOST if is_host(other) else ACCELERATOR
    named = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(named, str):  # as given: "cpu" from torch.distributed is a mesh's device type (_kind)
        return named
    try:
        return torch._C._nn._parse_to(*args[1:], **kwargs)[0]  # None when only a dtype is given
    except (TypeError, RuntimeError):
        return None


def _real_device_of_to(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`Tensor.to`'s arguments with the pretended accelerator (`cpu:0`) named as the CPU it is: a tensor already on
    the device is then returned as it is, not copied, as `.to("cuda:0")` returns a CUDA tensor on the GPU job (a
    move between the pretended devices is copied after the call)."""
    if len(args) > 1 and _is_accelerator_name(args[1]):
        args = (args[0], HOST, *args[2:])
    elif _is_accelerator_name(kwargs.get("device")):
        kwargs = {**kwargs, "device": HOST}
    return args, kwargs


def _is_accelerator_name(device: Any) -> bool:
    return (isinstance(device, torch.device) and device == ACCELERATOR) or (
        isinstance(device, str) and device.replace(" ", "") == "cpu:0")


_ROLES: dict = {}  # torch function -> (what the mode does with it, its name), decided at its first call


def _role(func) -> tuple[str, str]:
    try:
        return _ROLES[func]
    except KeyError:
        role = _classify(func)
        if len(_ROLES) < 65536:  # torch's functions are a fixed set; a function made per call is not kept
            _ROLES[func] = role
        return role
    except TypeError:  # not hashable
        return _classify(func)


def _classify(func) -> tuple[str, str]:
    if func == _GETTER:
        return "device", ""
    name = getattr(func, "__name__", "")
    if func in (torch.Tensor.backward, torch.autograd.backward):
        return "backward", name
    qualified = getattr(getattr(func, "_overloadpacket", func), "_qualified_op_name", "")  # an op or its packet
    if qualified.startswith("_c10d_functional::") and qualified.split("::")[1].startswith(_FUNCTIONAL):
        return "collective", name
    if name in ("cpu", "pin_memory"):
        return "host", name
    if name == "to" and func in (torch.Tensor.to,):
        return "to", name
    if name == "cuda":
        return "accelerator", name
    return "other", name


class _Tracker(TorchFunctionMode):
    """Follows host tensors through torch functions; reports the two pretended devices; checks functional
    collectives."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        role, name = _role(func)
        if role == "device":
            real = func(*args, **kwargs)
            if real.type != "cpu" or sys._getframe(1).f_globals.get("__name__") == "torch.utils.checkpoint":
                return real  # meta stays meta; checkpoint compares forward's (read inside an op) with backward's
            return HOST if is_host(args[0]) else ACCELERATOR
        if role == "backward":
            with self:  # the backward's hooks (FSDP2's reduce-scatter and offload) run under the mode too
                return _run_backward(func, args, kwargs)
        if role == "collective":
            _check_functional(func, args, kwargs)
        call_args, call_kwargs = _real_device_of_to(args, kwargs) if role == "to" else (args, kwargs)
        out = func(*call_args, **call_kwargs)
        if role == "other" and kwargs.get("device") is None:  # most calls: the result is where the inputs are
            kind = _inputs_kind(args, kwargs)
            if kind == "accelerator" or (kind is None and name.endswith("_like")):
                return out  # a new storage is the accelerator's (untagged); a view keeps its storage's tag
            for t in [out] if isinstance(out, torch.Tensor) else _tensors(out, []):
                _mark(t, True)  # host inputs only, or a factory on torch's default device (the host on a GPU job)
            return out
        outputs = [out] if isinstance(out, torch.Tensor) else _tensors(out, [])
        if not outputs:  # a flag, a size, a dtype, None: nothing to follow
            return out
        target: str | None
        if role == "host":
            target = "host"
        elif role == "to":
            target = _kind(_target_of_to(args, kwargs))
        elif role == "accelerator":
            target = "accelerator"
        else:
            target = _kind(kwargs.get("device"))
        inputs = _tensors(kwargs, _tensors(args, []))
        if target is None:
            if inputs or name.endswith("_like"):
                target = "host" if inputs and all(is_host(t) for t in inputs) else "accelerator"
            else:
                target = "host"  # a factory with no device: torch's default device, the host on a GPU job too
        if name in ("to", "cpu", "cuda", "pin_memory") and inputs and out is args[0]:
            if (target == "host") != is_host(args[0]):  # a move between the two devices copies, as on a GPU
                out = out.clone()
                outputs = [out]
        host = target == "host"
        for t in outputs:
            if not any(t is i for i in inputs):
                _mark(t, host)
        return out


def _run_backward(func, args: tuple, kwargs: dict) -> None:
    """torch.autograd.backward's work without its torch-function dispatch (which would call the mode again)."""
    import inspect

    from torch.autograd import _make_grads
    from torch.autograd.graph import _engine_run_backward

    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    values = bound.arguments
    tensors: Any
    grads: Any
    if func is torch.Tensor.backward:
        tensors, grads = (values["self"],), (values["gradient"],)
    else:
        tensors = values["tensors"]
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        grads = values.get("grad_tensors")
        grads = (None,) * len(tensors) if grads is None else (grads,) if isinstance(grads, torch.Tensor) else grads
    inputs = values.get("inputs")
    inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    create_graph = bool(values.get("create_graph"))
    retain_graph = values.get("retain_graph")
    _engine_run_backward(tensors, _make_grads(tensors, tuple(grads), is_grads_batched=False),
                         create_graph if retain_graph is None else retain_graph, create_graph, inputs,
                         allow_unreachable=True, accumulate_grad=True)


# -- which groups take host tensors -----------------------------------------------------------------------------
def note_cpu_group(group: Any) -> None:
    """`group` has a CPU backend on the GPU job too (made with backend="gloo")."""
    if group is not None:
        _cpu_groups.add(group)


def set_default_has_cpu(value: bool) -> None:
    """Whether the default group (and the groups that inherit its backends) has a CPU backend on the GPU job."""
    _state["default_has_cpu"] = value


def _has_cpu_backend(group: Any) -> bool:
    import torch.distributed as dist

    if group is None or group is dist.GroupMember.WORLD:
        return bool(_state["default_has_cpu"])
    if group in _cpu_groups:
        return True
    return bool(_state["default_has_cpu"])  # DeviceMesh's and new_group()'s groups inherit the default's backends


def _violation(op: str, tensor: torch.Tensor, group: Any) -> RuntimeError:
    frames = [f for f in traceback.extract_stack()[:-2] if "collective_check" not in f.filename]
    ours = [f for f in frames if f"{os.sep}accel{os.sep}" in f.filename] or frames
    where = f"{ours[-1].filename}:{ours[-1].lineno}" if ours else "?"
    backend = "cuda:nccl,cpu:gloo" if _has_cpu_backend(group) else "nccl"
    return RuntimeError(f"collective-device check: {op} at {where} sends a host (CPU) tensor of shape "
                        f"{tuple(tensor.shape)} over a group whose backend on a GPU job is {backend!r}: NCCL refuses "
                        "it (No backend type associated with device type cpu)")


def _check(op: str, tensors: list, group: Any) -> None:
    if _state["inside_object_collective"] or _has_cpu_backend(group):
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and is_host(t):
            raise _violation(op, t, group)


def _check_functional(func, args: tuple, kwargs: dict) -> None:
    from torch.distributed.distributed_c10d import _resolve_process_group

    names = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, str)]
    group = None
    for name in names:
        try:
            group = _resolve_process_group(name)  # type: ignore[arg-type]
            break
        except (RuntimeError, ValueError, KeyError):
            continue
    _check(str(func), _tensors(kwargs, _tensors(args, [])), group)


def expect_reduction(op: str, tensors: list) -> None:
    """A reduction torch makes inside an operator, out of the mode's sight (a Partial DTensor reduced within
    `vector_norm` over sharded gradients): `tensors` (DTensors) will be reduced over their meshes' groups. Checked
    here, by the caller, before the operator runs; nothing when the check is off."""
    if not _state["active"]:
        return
    for t in tensors:
        mesh = getattr(t, "device_mesh", None)
        if mesh is None or not is_host(t):
            continue
        for dim in range(mesh.ndim):
            _check(op, [t], mesh.get_group(dim))


def _wrap(name: str, original):
    @functools.wraps(original)
    def checked(*args, **kwargs):
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if type(a).__name__ == "ProcessGroup"), None)
        tensors = tree_flatten((args, kwargs))[0]
        if name == "batch_isend_irecv":  # P2POp entries
            tensors = [getattr(op, "tensor", None) for op in (args[0] if args else kwargs.get("p2p_op_list", []))]
            group = next((op.group for op in (args[0] if args else []) if getattr(op, "group", None)), group)
        _check(name, tensors, group)
        return original(*args, **kwargs)

    return checked


def _wrap_object(original):
    @functools.wraps(original)
    def unchecked(*args, **kwargs):
        _state["inside_object_collective"] += 1
        try:
            return original(*args, **kwargs)
        finally:
            _state["inside_object_collective"] -= 1

    return unchecked


def _accelerator_from_mesh(mesh) -> torch.device:
    """FSDP2's device for a mesh: the pretended accelerator for a CPU mesh (the GPU on a GPU job)."""
    return ACCELERATOR if mesh.device_type == "cpu" else torch.device(mesh.device_type, torch.cuda.current_device())


def activate(default_has_cpu: bool) -> None:
    """Start the check in this process (once): the mode, the wrapped collectives, FSDP2's device for a mesh.
    `default_has_cpu`: the default group would have a CPU backend on the GPU job."""
    _state["default_has_cpu"] = default_has_cpu
    if _state["active"]:
        return
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    # one wrapper per function, set in both modules: torch compares some by identity (P2POp's op is isend/irecv)
    for names, wrap in ((_COLLECTIVES, _wrap), (_OBJECT_COLLECTIVES, lambda _, original: _wrap_object(original))):
        for name in names:
            original = getattr(c10d, name, None)
            if original is None or getattr(original, "_accel_checked", False):
                continue
            wrapped = wrap(name, original)
            wrapped._accel_checked = True
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    setattr(module, name, wrapped)
    try:
        import torch.distributed.fsdp._fully_shard._fully_shard as fully_shard_module

        fully_shard_module._get_device_from_mesh = _accelerator_from_mesh
    except ImportError:
        pass
    # a tensor's storage saved while it reported cpu:0 (torch.save, deepcopy) is restored on the CPU
    torch.serialization.register_package(5, lambda _: None,
                                         lambda obj, location: obj if location.startswith("cpu:") else None)
    _Tracker().__enter__()  # for the rest of the process
    _state["active"] = True
