"""Process state: rank, world size, local rank, device, and the lifetime of the default process group.

It reads torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), under `srun` or `mpirun` without a
launcher made from SLURM's or MPI's variables first, once every scheduler's variables agree (accel.runtime.cluster_env).
There is one process group per process, so there is one state per process: `PartialState()` returns it.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import gc
import os
from datetime import timedelta
from typing import Any, Callable, cast

import torch
import torch.distributed as dist

from accel.core.diagnostics import install_worker_hooks
from accel.config.degrees import layout_words
from accel.config.kwargs import as_timeout, process_group_backend
from accel.core.probes import is_cuda_available  # NVML: asking does not initialise CUDA (forks stay usable)


class DistributedType(str, enum.Enum):
    """What kind of run this is (Accelerate's enum; compare with `==` or against its string values)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    # Accelerate's other values, so scripts that compare against them run; accel reports the hardware kind
    # above (its ZeRO backend is selected by the config, not by a distributed type).
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    MEGATRON_LM = "MEGATRON_LM"
    XLA = "XLA"
    MULTI_NPU = "MULTI_NPU"
    MULTI_XPU = "MULTI_XPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"

    def __str__(self) -> str:
        return self.value


def _env_device() -> torch.device | None:
    """The device named by ACCELERATE_TORCH_DEVICE, Accelerate's variable that Ray Train sets in each worker."""
    value = os.environ.get("ACCELERATE_TORCH_DEVICE")
    if not value:
        return None
    try:
        return torch.device(value)
    except RuntimeError:
        raise ValueError(f"environment variable ACCELERATE_TORCH_DEVICE={value!r} is not a torch device; allowed: a "
                         "device string such as cpu, cuda, cuda:1") from None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer; torchrun sets it to one") from None


class PartialState:
    """The process's distributed state (Accelerate's `PartialState`): one instance per process.

    Examples:
        >>> state = PartialState()
        >>> state.process_index, state.num_processes, state.device
    """

    _instance: "PartialState | None" = None
    _initialized: bool  # in the shared dict, set by __new__
    # Every instance shares one attribute dict (Accelerate's shared state): an object kept from before
    # `_reset_state()` is unusable until a new PartialState() initialises the state again, then sees it.
    _shared_state: dict = {}
    # (owns the process group, release callbacks) of a state forgotten by _reset_state()
    _carried: "tuple[bool, list] | None" = None

    def __new__(cls, cpu: bool = False, **kwargs: Any) -> "PartialState":
        if PartialState._instance is None:
            instance = super().__new__(PartialState)
            instance.__dict__ = PartialState._shared_state
            instance.__dict__.setdefault("_initialized", False)
            PartialState._instance = instance
        if cls is not PartialState:  # AcceleratorState: its own object over the same attribute dict
            return cast("type[AcceleratorState]", cls)._view()
        return PartialState._instance

    def __init__(self, cpu: bool = False, backend: str | None = None, init_method: str | None = None,
                 timeout: timedelta | None = None, cpu_collectives: bool = False, **_: Any) -> None:
        """`cpu_collectives` (accel's, from Accelerator: the config offloads to the CPU): the GPU job's default group
        gets a gloo backend for CPU tensors beside NCCL (`process_group_backend`)."""
        if self._initialized:
            return
        from accel.core.restarts import export_restart_count

        export_restart_count()  # again: a worker forked by notebook_launcher imported accel before its restart
        if not dist.is_initialized():
            from accel.runtime.cluster_env import export_task_env

            # `srun` or `mpirun` without a launcher: RANK, WORLD_SIZE, ... from SLURM's task variables, else MPI's,
            # once every scheduler's variables agree; a Kubeflow Trainer pod that asks for several processes needs a
            # launcher. A refusal is a ClusterEnvError: one line, printed alone when uncaught (accel.core.uncaught)
            export_task_env()
        self.num_processes = _env_int("WORLD_SIZE", 1)
        self.process_index = _env_int("RANK", 0)
        self.local_process_index = _env_int("LOCAL_RANK", 0)
        self.use_cpu = cpu
        # Accelerate's debug mode: collectives check that every process passes the same shapes (accel.runtime.ops)
        from accel.core.probes import parse_flag_from_env

        self.debug = parse_flag_from_env("ACCELERATE_DEBUG_MODE") or parse_flag_from_env("ACCEL_DEBUG_MODE")
        # ACCELERATE_TORCH_DEVICE (set by Ray Train's TorchTrainer for each worker) wins, even over cpu=True, as in
        # Accelerate
        self.device = _env_device() or (torch.device("cpu") if cpu else self.default_device)
        self.set_device()
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        group_backend = process_group_backend(self.backend, self.device.type, cpu_collectives)
        from accel.core import collective_check

        if collective_check.requested() and self.num_processes > 1 and self.device.type == "cpu":
            # a CPU run checked as the CUDA job it stands for: the accelerator is cpu:0, the groups are gloo,
            # and a host tensor sent where the GPU job's groups would be NCCL-only fails (accel.core.collective_check)
            self.device = collective_check.ACCELERATOR
            collective_check.activate(default_has_cpu=":" in process_group_backend(None, "cuda", cpu_collectives))
        owned, callbacks = PartialState.__dict__.get("_carried") or (False, [])
        PartialState._carried = None  # taken over from a state forgotten by _reset_state()
        self._release_callbacks: list[Callable[[], None]] = list(callbacks)
        self._owns_group = owned and dist.is_initialized()
        if self.num_processes > 1:
            if not dist.is_initialized():
                timeout = _collective_timeout(timeout)
                install_worker_hooks(self.process_index, timeout.total_seconds())  # a hang names the stuck rank
                kwargs: dict[str, Any] = {"backend": group_backend, "timeout": timeout}
                if init_method:
                    kwargs["init_method"] = init_method
                else:
                    kwargs.update(_store_of_this_attempt(self.process_index, self.num_processes, timeout))
                if self.device.type == "cuda" and "nccl" in group_backend:
                    kwargs["device_id"] = self.device  # eager NCCL init bound to our GPU
                _use_for_later_groups(timeout)
                dist.init_process_group(**kwargs)
                self._owns_group = True
            elif dist.get_world_size() != self.num_processes:
                raise RuntimeError(f"a process group of size {dist.get_world_size()} already exists but WORLD_SIZE="
                                   f"{self.num_processes}")
            else:
                install_worker_hooks(self.process_index)
        atexit.register(self.destroy)
        self._initialized = True

    # -- identity -----------------------------------------------------------------------------------------
    @property
    def distributed_type(self) -> DistributedType:
        override = self.__dict__.get("_distributed_type")
        if override is not None:
            return override
        if self.num_processes <= 1:  # also with an FSDP plugin: this is PartialState too, and transformers' gathers
            return DistributedType.NO  # take anything else for a process group
        if self.__dict__.get("fsdp_plugin") is not None:  # ZeRO 2/3 shard with FSDP2 (accel.checkpoint.fsdp_compat)
            return DistributedType.FSDP
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    @distributed_type.setter
    def distributed_type(self, value: DistributedType) -> None:
        """Accelerate's state attribute is writable (its tests set it to see other code paths); accel reports the
        value set, and its backend is unchanged: it comes from the config."""
        self.__dict__["_distributed_type"] = DistributedType(value)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_release_callbacks"}  # process-local callbacks

    def __setstate__(self, state: dict) -> None:
        """The process state belongs to the process: unpickling where one exists keeps it (the pickled copy is the
        same job's state), and elsewhere restores it without the release callbacks."""
        if not self.__dict__.get("_initialized"):
            self.__dict__.update(state, _release_callbacks=[])

    def __repr__(self) -> str:
        """Accelerate's summary: PartialState's fields, then, once an Accelerator has set them, AcceleratorState's
        (mixed precision; the DeepSpeed config when a plugin is given); then accel's layout (kind and degrees)."""
        if not self.initialized:
            return object.__repr__(self)
        backend = f"  Backend: {self.backend}" if self.use_distributed else ""  # one process: no process group
        text = (f"Distributed environment: {self.distributed_type}{backend}\n"
                f"Num processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\n"
                f"Local process index: {self.local_process_index}\n"
                f"Device: {self.device}\n")
        shared = self.__dict__
        if "mixed_precision" not in shared:  # no Accelerator yet
            return text
        text += f"\nMixed precision type: {shared['mixed_precision']}\n"
        if shared.get("deepspeed_plugin") is not None:
            text += f"ds_config: {shared['deepspeed_plugin'].deepspeed_config}\n"
        topology, parallelism = shared.get("topology"), shared.get("parallelism_config")
        if topology is not None and parallelism is not None:
            words = layout_words(parallelism, topology.dp_replicate_size, topology.dp_shard_size, every=True)
            text += f"Parallelism: {words}\n"
        return text

    def get_deepspeed_plugin(self, name: str):
        """The DeepSpeed plugin given under `name` to `Accelerator(deepspeed_plugins={...})` (Accelerate's)."""
        plugins = self.__dict__.get("_deepspeed_plugin_table") or {}
        if not plugins:
            raise ValueError("get_deepspeed_plugin: no DeepSpeed plugin was given to Accelerator(deepspeed_plugin(s)=)")
        return plugins[name]

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        """Only the active (first) plugin can be selected: accel prepares every model with one config."""
        plugins = self.__dict__.get("_deepspeed_plugin_table") or {}
        if not plugins:
            raise ValueError("select_deepspeed_plugin: no DeepSpeed plugin was given to "
                             "Accelerator(deepspeed_plugin(s)=)")
        if name not in plugins:
            raise ValueError(f"select_deepspeed_plugin: bad value {name!r}; allowed: {', '.join(map(repr, plugins))}")
        first = next(iter(plugins))
        if name != first:
            raise NotImplementedError(f"select_deepspeed_plugin({name!r}): a second active DeepSpeed plugin is not "
                                      f"available yet in accel; allowed: {first!r} (every model uses its config)")

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def restart_count(self) -> int:
        """How many times `accel launch --max_restarts N` restarted the worker group before this attempt (0 on the
        first): ACCEL_RESTART_COUNT, from torchrun's TORCHELASTIC_RESTART_COUNT."""
        return _env_int("ACCEL_RESTART_COUNT", 0)

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def fork_launched(self) -> bool:
        """Accelerate's: whether the processes were forked by `notebook_launcher` (FORK_LAUNCHED=1 in the env)."""
        return os.environ.get("FORK_LAUNCHED", "0").lower() in ("1", "true", "yes", "y", "on")

    # -- synchronisation ----------------------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        if self.use_distributed and dist.is_initialized():
            dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self):
        """Run the block on the main process first (e.g. to download or preprocess), then on the others."""
        yield from self._first(self.is_main_process)

    @contextlib.contextmanager
    def local_main_process_first(self):
        yield from self._first(self.is_local_main_process)

    def _first(self, is_first: bool):
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False):
        """Yield this process's contiguous share of a list, tuple, dict of lists, or tensor."""
        yield split_for_process(inputs, self.num_processes, self.process_index, apply_padding)

    def on_main_process(self, function: Callable | None = None) -> Callable:
        """Decorator: run `function` only on the main process (`@on_main_process()` too)."""
        if function is None:
            return self.on_main_process
        return self._only_if(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable | None = None) -> Callable:
        if function is None:
            return self.on_local_main_process
        return self._only_if(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable) -> Callable:
        return self._only_if(function, lambda: self.is_last_process)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        if function is None:
            return lambda f: self.on_process(f, process_index)
        return self._only_if(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        if function is None:
            return lambda f: self.on_local_process(f, local_process_index)
        return self._only_if(function, lambda: self.local_process_index == local_process_index)

    def check_cpu_collectives(self, offload: bool) -> None:
        """CPU offload on a GPU job needs a default group with a CPU backend (`process_group_backend`); one made
        before `Accelerator(...)` without it is refused here, in one line, rather than on the first clipped step.
        Under the collective-device check each Accelerator is checked as if it had made the group (a test's
        jobs share one process: each stands for a job of its own)."""
        from accel.core import collective_check

        if collective_check.active():
            collective_check.set_default_has_cpu(":" in process_group_backend(None, "cuda", offload))
            return
        if not offload or self.num_processes <= 1 or not dist.is_initialized() or self.device.type != "cuda":
            return
        if "cpu:" not in str(dist.get_backend_config()):
            raise ValueError(f"CPU offload (offload_params/offload_optimizer) on a {self.device.type} job needs a "
                             "process group with a CPU backend, but the default group was created before "
                             f"Accelerator() with backend {self.backend!r}; allowed: create it with "
                             "PartialState(backend='cuda:nccl,cpu:gloo'), or let Accelerator() create it")

    @property
    def initialized(self) -> bool:
        return bool(self.__dict__.get("_initialized"))

    @property
    def default_device(self) -> torch.device:
        """The device this process would use (Accelerate's): its GPU under CUDA, else the CPU."""
        if is_cuda_available():
            return torch.device("cuda", self.local_process_index % max(torch.cuda.device_count(), 1))
        return torch.device("cpu")

    def set_device(self) -> None:
        """Make this process's device the current one (CUDA); nothing to do on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @staticmethod
    def _only_if(function: Callable, condition: Callable[[], bool]) -> Callable:
        import functools

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if condition():
                return function(*args, **kwargs)
            return None

        return wrapper

    def print(self, *args, **kwargs) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    # -- teardown -----------------------------------------------------------------------------------------
    def add_release_callback(self, callback: Callable[[], None]) -> None:
        """Called before the process group is destroyed, to drop objects (DDP reducers) that use it."""
        self._release_callbacks.append(callback)

    def destroy(self) -> None:
        """Release wrapped modules, collect garbage, then destroy the process group we created.

        Destroying the group while a DDP reducer still holds it made ranks die with SIGABRT at exit on
        torch 2.13; releasing first removes that.
        """
        state = self.__dict__
        if not state.get("_initialized") and PartialState._carried:  # forgotten by _reset_state(), not taken over
            state = {"_owns_group": PartialState._carried[0], "_release_callbacks": PartialState._carried[1]}
            PartialState._carried = None
        callbacks, state["_release_callbacks"] = state.get("_release_callbacks", []), []
        for callback in callbacks:
            callback()
        gc.collect()
        if state.get("_owns_group") and dist.is_initialized():
            dist.destroy_process_group()
        state["_owns_group"] = False

    @property
    def device_mesh(self):
        """Accelerate's `AcceleratorState.device_mesh`: the Accelerator's DeviceMesh of the parallel dimensions (built
        by every process together, as `prepare` does), None on one process or before an Accelerator exists."""
        topology = self.__dict__.get("topology")  # set by the Accelerator: its one mesh, not a second one
        if self.num_processes <= 1 or topology is None:
            return None
        return topology.mesh(self.device.type)

    def init_one_rank_group(self, backend: str) -> None:
        """A default process group of this process alone (FSDP2 on one process needs one), over an in-process store
        (no address or port to agree on); destroyed with the state, as a multi-process run's group is."""
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        self._owns_group = True

    def destroy_process_group(self, group=None) -> None:
        """Accelerate's name for the end of a distributed run: release what uses the group, then destroy it (a
        `group` given is destroyed alone)."""
        if group is not None:
            if dist.is_initialized():
                dist.destroy_process_group(group)
            return
        self.destroy()

    def __getattr__(self, name: str):
        kind = type(self).__name__  # PartialState or AcceleratorState, as Accelerate's errors name them
        if name in ("num_processes", "process_index", "local_process_index", "device", "backend", "use_cpu"):
            raise AttributeError(f"`{kind}` object has no attribute `{name}`. This happens if `{kind}._reset_state()` "
                                 "was called and an `Accelerator` or `PartialState` was not reinitialized.")
        raise AttributeError(f"'{kind}' object has no attribute '{name}'")

    @classmethod
    def _reset_for_tests(cls) -> None:
        instance = PartialState._instance
        if instance is not None and instance._initialized:
            instance.destroy()
        PartialState._shared_state.clear()  # objects kept from before are unusable until the state is re-initialised
        PartialState._instance = None

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Accelerate's name (its test helpers call it between tests): forget the state, so objects that still hold
        it are unusable until a new `Accelerator()`/`PartialState()` initialises it again. The process group stays
        (as in Accelerate); the next state takes it over, with the release callbacks of what uses it."""
        if cls._shared_state.get("_initialized"):
            shared = cls._shared_state
            PartialState._carried = (shared.get("_owns_group", False), shared.get("_release_callbacks", []))
        cls._shared_state.clear()
        PartialState._instance = None


class AcceleratorState(PartialState):
    """Accelerate's `AcceleratorState` (what `accelerator.state` is): in accel the same process state as PartialState,
    one attribute dict seen through both (a value set on one is read on the other, and `_reset_state()` of either
    forgets both), under its own name: errors name it as Accelerate's do."""

    _view_object: "AcceleratorState | None" = None

    @classmethod
    def _view(cls) -> "AcceleratorState":
        shared = cast(PartialState, PartialState._instance).__dict__
        view = cls.__dict__.get("_view_object")
        if view is None or view.__dict__ is not shared:
            view = object.__new__(cls)
            view.__dict__ = shared
            cls._view_object = view
        shared.setdefault("_initialized", False)
        return view


def _store_of_this_attempt(rank: int, world_size: int, timeout: timedelta) -> dict[str, Any]:
    """init_process_group's store once `--max_restarts` restarted the group: the elastic agent's, with the keys scoped
    by the restart number (as torch 2.4 did). torch 2.13 keeps one agent store for the whole run and leaves the
    keys unscoped, so a restarted group read the dead workers' addresses (gloo: 'connectFullMesh failed ...
    Connection refused', or a hang; NCCL: a stale unique id; pytorch/pytorch#135712). Nothing on a first attempt."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restart == "0":
        return {}
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 0), world_size, is_master=False,
                                timeout=timeout)
    return {"store": dist.PrefixStore(f"accel/attempt_{restart}", agent_store), "rank": rank, "world_size": world_size}


def _collective_timeout(timeout: Any) -> timedelta:
    """How long a collective may wait: `timeout` from code (PartialState(timeout=), InitProcessGroupKwargs) wins over
    the config's `collective_timeout` (the launched config, else the config files)."""
    if timeout is not None:
        return cast(timedelta, as_timeout(timeout, "PartialState: argument 'timeout'"))  # None only for None
    from accel.config import worker_config

    return timedelta(seconds=worker_config().collective_timeout)


def _use_for_later_groups(timeout: timedelta) -> None:
    """Groups made after the default one (DeviceMesh's TP/ZeRO dimensions, new_group) get torch's default timeout (30
    minutes on gloo, 10 on NCCL), not the default group's; torch reads that default from these two names."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


def __getattr__(name: str):
    if name == "GradientState":  # Accelerate's scripts import it from accelerate.state
        from accel.runtime.accumulation import GradientState

        return GradientState
    raise AttributeError(f"module 'accel.runtime.state' has no attribute {name!r}")


def check_device_matches(config, device: torch.device) -> None:
    """A config that asks for GPUs must not quietly run on the CPU."""
    if config.distributed_type == "MULTI_GPU" and device.type != "cuda":
        raise RuntimeError("config: distributed_type MULTI_GPU but no CUDA device is in use here (none visible, or "
                           "use_cpu is set); set use_cpu: true / pass --cpu, or omit distributed_type")


def split_for_process(inputs: Any, num_processes: int, index: int, apply_padding: bool = False) -> Any:
    """Contiguous split: the first `len % n` processes get one extra item (Accelerate's rule)."""
    if num_processes == 1:
        return inputs
    if isinstance(inputs, dict):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) != 1:
            raise ValueError("split_between_processes: all values of the dict must have the same length")
        return {k: split_for_process(v, num_processes, index, apply_padding) for k, v in inputs.items()}
    length = len(inputs)
    per, extra = divmod(length, num_processes)
    start = index * per + min(index, extra)
    end = start + per + (1 if index < extra else 0)
    part = inputs[start:end]
    if apply_padding and extra and index >= extra and length:
        last = inputs[-1:] if not isinstance(inputs, torch.Tensor) else inputs[-1:]
        if isinstance(part, torch.Tensor):
            part = torch.cat([part, last])
        else:
            part = part + type(part)(last)
    return part
