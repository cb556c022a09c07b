"""Kwargs handlers (Accelerate's names): small dataclasses that carry options to the machinery they tune."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, TypeVar


class KwargsHandler:
    """Base class: `to_kwargs()` returns only the fields changed from their defaults."""

    def to_kwargs(self) -> dict[str, Any]:
        defaults = type(self)()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)  # type: ignore[arg-type]  # subclasses are dataclasses
                if getattr(self, f.name) != getattr(defaults, f.name)}

    def to_dict(self) -> dict[str, Any]:
        """Every attribute (a deep copy), as Accelerate's."""
        import copy

        return copy.deepcopy(self.__dict__)


class DDPCommunicationHookType(str, enum.Enum):
    """Accelerate's names for torch's DDP communication hooks (`torch.distributed.algorithms.ddp_comm_hooks`)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"

    @classmethod
    def list(cls) -> list[str]:
        """The values, as Accelerate's enums list them."""
        return [member.value for member in cls]


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Options of `torch.nn.parallel.DistributedDataParallel`. `comm_hook` is a `DDPCommunicationHookType` (gradients
    compressed to fp16/bf16, or PowerSGD), optionally wrapped by an fp16/bf16 `comm_wrapper`, with PowerSGD's
    `comm_state_option`s (Accelerate's); or a hook function of your own with its `comm_state`."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: Callable | str | None = None
    comm_state: Any = None
    comm_wrapper: str | None = None
    comm_state_option: dict = field(default_factory=dict)

    def to_dict(self, ignore_keys=("comm_hook", "comm_wrapper", "comm_state_option")) -> dict[str, Any]:
        """Every attribute but `ignore_keys` (the hook options, which are not DDP's arguments), as Accelerate's."""
        return {k: v for k, v in super().to_dict().items() if k not in ignore_keys}


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Options of `torch.amp.GradScaler` (fp16 dynamic loss scaling)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Options of `torch.distributed.init_process_group`. `timeout` (a timedelta, or seconds) is how long a collective
    may wait for every process; it wins over the config's `collective_timeout` (None: that one)."""

    backend: str | None = None
    init_method: str | None = None
    timeout: timedelta | None = None

    def __post_init__(self) -> None:
        self.timeout = as_timeout(self.timeout, "InitProcessGroupKwargs: argument 'timeout'")


def as_timeout(value: Any, where: str) -> timedelta | None:
    """`value` (a timedelta or a number of seconds, > 0) as a timedelta; None stays None; ValueError otherwise."""
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < 1e9:
        raise ValueError(f"{where}: bad value {value!r}; allowed: a datetime.timedelta or a number of seconds > 0")
    return value if isinstance(value, timedelta) else timedelta(seconds=value)


def process_group_backend(backend: str | None, device_type: str, cpu_collectives: bool) -> str:
    """The backend string for the default process group.

    Decided once for every GPU job: accel's own collectives send tensors on the job's device, so NCCL alone serves
    them. The exception is CPU offload: FSDP2 keeps the offloaded gradients on the CPU and reduces CPU tensors that
    accel does not make (the gradient norm of `clip_grad_norm_`, the sharded grad scaler's inf flag), so a job that
    offloads gets gloo for CPU tensors beside NCCL, `"cuda:nccl,cpu:gloo"` (torch's own default when no backend is
    named; torchtitan does the same for offload). A backend the user names is kept, except that under offload one with
    no CPU backend ("nccl", "cuda:nccl") gets gloo added for CPU tensors (it would fail on the first clipped step)."""
    chosen = backend or ("nccl" if device_type == "cuda" else "gloo")
    if cpu_collectives and device_type == "cuda" and "gloo" not in chosen and "cpu:" not in chosen:
        return ("cuda:" + chosen if ":" not in chosen else chosen) + ",cpu:gloo"  # nccl, cuda:nccl: gloo beside
    return chosen


@dataclass
class AutocastKwargs(KwargsHandler):
    """Options of `torch.autocast`."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class AORecipeKwargs(KwargsHandler):
    """Accelerate's recipe for mixed_precision fp8 with torchao: `config` is a `torchao.float8.Float8LinearConfig`
    (None: torchao's defaults, with float8 all-gather under ZeRO 2/3), `module_filter_func(module, name)` chooses
    the layers to convert (None: accel's default, see accel/backends/float8.py)."""

    config: Any = None
    module_filter_func: Callable | None = None


class _UnavailableRecipe(KwargsHandler):
    """Accelerate's fp8 recipes for Transformer Engine and MS-AMP: importable (scripts import them beside
    AORecipeKwargs), but accel's fp8 is torchao's, so building one is a one-line NotImplementedError."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}: Transformer Engine / MS-AMP fp8 is not available in accel "
                                  "(its fp8 is torchao's); allowed: AORecipeKwargs")


class TERecipeKwargs(_UnavailableRecipe):
    """Accelerate's Transformer Engine fp8 recipe (not available: see _UnavailableRecipe)."""


class MSAMPRecipeKwargs(_UnavailableRecipe):
    """Accelerate's MS-AMP fp8 recipe (not available: see _UnavailableRecipe)."""


class FP8RecipeKwargs(_UnavailableRecipe):
    """Accelerate's deprecated name for TERecipeKwargs / MSAMPRecipeKwargs (not available: see _UnavailableRecipe)."""


@dataclass
class ProfileKwargs(KwargsHandler):
    """Options of `torch.profiler.profile` for `Accelerator.profile()` (Accelerate's): `activities` are names
    ("cpu", "cuda", "xpu", "mtia", "hpu"; None: torch's default), `schedule_option` goes to
    `torch.profiler.schedule`, and with `output_trace_dir` each process writes a Chrome trace
    `profile_<process_index>.json` there."""

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def _get_profiler_activity(self, activity: str):
        """A name -> torch's ProfilerActivity, for the devices this machine has (Accelerate's rule)."""
        import torch

        kinds = torch.profiler.ProfilerActivity
        found = {"cpu": kinds.CPU, "cuda": kinds.CUDA}
        for name in ("xpu", "mtia", "hpu"):
            device = getattr(torch, name, None)
            if hasattr(kinds, name.upper()) and device is not None and device.is_available():
                found[name] = getattr(kinds, name.upper())
        if activity not in found:
            raise ValueError(f"ProfileKwargs: argument 'activities': bad value {activity!r}; allowed: "
                             f"{', '.join(found)}")
        return found[activity]

    def build(self):
        """A `torch.profiler.profile` with these options (not started)."""
        import torch

        activities = None if self.activities is None else [self._get_profiler_activity(a) for a in self.activities]
        schedule = None if self.schedule_option is None else torch.profiler.schedule(**self.schedule_option)
        return torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self.on_trace_ready,
                                      record_shapes=self.record_shapes, profile_memory=self.profile_memory,
                                      with_stack=self.with_stack, with_flops=self.with_flops,
                                      with_modules=self.with_modules)


@dataclass
class ThroughputMonitorKwargs(KwargsHandler):
    """accel's own (Accelerate has none): the throughput monitor's options; passing it in `kwargs_handlers` turns the
    monitor on (accel/runtime/throughput.py). `log_every`: optimizer steps per report (None: the config's
    `throughput_log_every`); `flops_per_token`: FLOPs of forward + backward per token (per sample where batches
    carry no token ids), for MFU where accel cannot count them (a model without a transformers config) or to
    override its count; `peak_flops`: the device's peak FLOP/s, for a device accel's table lacks or to override it."""

    log_every: int | None = None
    flops_per_token: float | None = None
    peak_flops: float | None = None

    def __post_init__(self) -> None:
        if self.log_every is not None and (isinstance(self.log_every, bool) or not isinstance(self.log_every, int)
                                           or not 1 <= self.log_every <= 2**31 - 1):
            raise ValueError(f"ThroughputMonitorKwargs: argument 'log_every': bad value {self.log_every!r}; allowed: "
                             "an integer >= 1 (or None: the config's throughput_log_every)")
        for name in ("flops_per_token", "peak_flops"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < float("inf")):
                raise ValueError(f"ThroughputMonitorKwargs: argument '{name}': bad value {value!r}; allowed: a "
                                 "finite number > 0 (or None)")


HandlerT = TypeVar("HandlerT", bound=KwargsHandler)


def find_handler(handlers, cls: type[HandlerT]) -> HandlerT | None:
    """The handler of type `cls` among the user's kwargs_handlers, if any (at most one of each kind)."""
    found = [h for h in (handlers or []) if isinstance(h, cls)]
    if len(found) > 1:
        raise ValueError(f"kwargs_handlers: more than one {cls.__name__} given; pass at most one of each kind")
    return found[0] if found else None
