"""The fault-tolerant data-parallel backend: the recipe's DDP step over torchft.

What changes against plain DDP (accel/backends/spmd.py), and nothing else:

* **the model**: with one process per replica group, torchft's own `DistributedDataParallel` (its gradients
  all-reduced over the live groups by the Manager); with several, torch's DDP over the group whose communication
  hook first averages each bucket inside the group, then over the groups with the Manager's all-reduce (rank i of
  each group with rank i of the others). Both hooks report a failed all-reduce to the Manager (the step is then not
  committed) instead of torchft's hook's assertion, which crashed the live group when a peer died mid-all-reduce.
  Bucket layouts are fixed at prepare (`fix_bucket_layout`), so a restarted group's buckets match the live ones.
* **the optimizer**: torchft's `Optimizer` wrapper, whose `step` asks the Manager whether every process of the
  group, and enough groups (`min_replicas`), got through the all-reduce (`should_commit`); otherwise the step is
  skipped. The quorum of a step is started at the step's first forward under autograd (a forward pre-hook), so the
  loop needs no `zero_grad` at a particular place.
* **the data**: each process's shard is `group_rank + group_world * replica_id` of `group_world * group_size`, the
  formula of torchft's `DistributedSampler`, through accel's own loader (resumable, even batches, seeds).
* **healing**: a group that (re)joins behind the others receives, before its first commit, from the same rank of
  a live group (`recover_src_replica_rank` in torchft's log), everything `save_state` would save (one capture,
  accel/checkpoint/training_state.py: models, optimizers, schedulers, scaler, registered objects, step counters, RNG
  states) and the position of the loader being iterated.
* **the start**: the first step waits (up to `start_timeout`) until every group has come, so a job without failures
  is DDP whatever the start skew.
* **the check**: the groups compare a fingerprint of their weights every `check_every` committed steps and at the
  end (accel/fault_tolerance/fingerprint.py); a difference stops the job in one line.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from accel.backends.base import register_backend
from accel.backends.ddp import apply_ddp
from accel.backends.spmd import SpmdBackend
from accel.config.kwargs import DistributedDataParallelKwargs, find_handler
from accel.config.schema import FaultToleranceConfig
from accel.fault_tolerance import fingerprint, require_torchft

REPLICA_PREFIX = "accel_group_"  # torchft derives a group's index from the trailing digits of its replica id


def lighthouse_url(address: str) -> str:
    """torchft's clients take http://host:port."""
    return address if address.startswith(("http://", "https://")) else f"http://{address}"


def _over_replicas(manager, buffer: torch.Tensor):
    """Average `buffer` in place over the live replica groups (torchft's Manager all-reduce), as a completed future.

    torchft's own DDP hook asserts on the future of an all-reduce that failed (a peer group died during it), which
    crashed the live group; here the failure stays what torchft means it to be: reported to the Manager (its
    `should_commit` then says no, the step is not applied) while the group trains on."""
    manager.allreduce(buffer).wait()  # False on failure, already reported to the Manager
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(buffer)
    return done


def _group_then_replicas(state, bucket):  # no annotations: DDP checks them as classes, and here they are strings
    """DDP communication hook for groups of several processes: the bucket (a dist.GradBucket) averaged over the
    group, then over the live replica groups. A failure inside the group (a process of this group died) raises:
    torchrun restarts the group, which then heals."""
    manager, group, size = state
    buffer = bucket.buffer()
    dist.all_reduce(buffer, group=group)
    buffer.div_(size)
    return _over_replicas(manager, buffer)


def _fault_tolerant_ddp():
    """torchft's DistributedDataParallel (one process per group: a dummy process group under DDP, buckets never
    rebuilt, gradients all-reduced by the Manager), with the hook above."""
    from torchft.ddp import DistributedDataParallel

    class FaultTolerantDDP(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):
            return _over_replicas(state, bucket.buffer())

    return FaultTolerantDDP


class FaultTolerantRun:
    """One process's torchft Manager and the step protocol around it (start the quorum once per step, commit)."""

    def __init__(self, config: FaultToleranceConfig, group_rank: int, group_world: int, device: torch.device):
        torchft = require_torchft()
        if config.replica_id is None:
            raise RuntimeError("fault_tolerance: this process has no replica_id; allowed: start it with `accel launch` "
                               "(which gives each group its replica_id) or set fault_tolerance.replica_id")
        if config.lighthouse == "start":
            raise RuntimeError("fault_tolerance.lighthouse: 'start' reached a worker; allowed: the host:port of a "
                               "running lighthouse (accel launch fills it in for the groups it starts)")
        timeout = timedelta(seconds=config.timeout)
        pg = torchft.ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else \
            torchft.ProcessGroupGloo(timeout=timeout)
        self.config = config
        self.replica_id = config.replica_id
        self._store, store_addr, store_port = _attempt_store(group_rank, group_world)
        self.manager = torchft.Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=config.min_replicas,
            timeout=timeout, quorum_timeout=timedelta(seconds=config.quorum_timeout),
            rank=group_rank, world_size=group_world, lighthouse_addr=lighthouse_url(config.lighthouse),
            replica_id=f"{REPLICA_PREFIX}{config.replica_id}", store_addr=store_addr, store_port=store_port,
            # the quorum (and a healing) completes before the step's forward: a group that heals takes part in that
            # step with the weights it received, so a run without failures is plain DDP from its first step
            use_async_quorum=False,
            # semi-synchronous: the first quorum comes after sync_steps local steps, where torchft's step-0 sync would
            # replace the group's local steps by another group's; the groups start alike (set_seed) instead
            init_sync=config.semi_sync_method is None,
        )
        self.quorum_started = False
        self.started = config.semi_sync_method is not None  # (semi-synchronous: torchft's own first quorum)
        self._device = device

    def start_step(self) -> None:
        """The step's quorum (and, for a group behind the others, its healing), once per step."""
        if not self.quorum_started:
            self.manager.start_quorum()
            if not self.started:
                self._wait_for_every_group()
            self.quorum_started = True

    def _wait_for_every_group(self) -> None:
        """At the job's first step (no group has committed yet), form quorums again until every group is in one or
        `start_timeout` has passed; the ranks of a group follow its rank 0's decision. A group that comes later (or
        restarts after a failure) finds committed steps and heals instead."""
        deadline = time.monotonic() + self.config.start_timeout
        while True:
            short = self.manager.current_step() == 0 and self.manager.num_participants() < self.config.group_size
            again = _group_decides(short and time.monotonic() < deadline, self._device)
            if not again:
                break
            time.sleep(0.2)
            self.manager.start_quorum()
        self.started = True
        if self.manager.current_step() == 0 and self.manager.num_participants() < self.config.group_size:
            self._say_left_behind()

    def _say_left_behind(self) -> None:
        here = torch.zeros(self.config.group_size, dtype=torch.float64)
        here[int(self.replica_id or 0)] = 1.0
        buffer = here.to(self._device)
        self.manager.allreduce(buffer, reduce_op=dist.ReduceOp.MAX).wait()
        missing = [g for g, came in enumerate(buffer.cpu().tolist()) if not came]
        if self.manager.participating_rank() == 0 and (not dist.is_initialized() or dist.get_rank() == 0):
            sys.stderr.write(f"accel: fault tolerance: replica group(s) {', '.join(map(str, missing))} not come "
                             f"within fault_tolerance.start_timeout ({self.config.start_timeout:g} s); the others "
                             "start without them (they heal from them when they come)\n")
            sys.stderr.flush()

    def step_done(self) -> None:
        self.quorum_started = False

    def register(self, key: str, obj: Any) -> None:
        """Send `obj`'s state_dict to a healing group, load it when this group heals."""
        self.manager.register_state_dict_fn(key, obj.load_state_dict, obj.state_dict)

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.manager.shutdown(wait=False)


def _attempt_store(group_rank: int, group_world: int):
    """(the store's server or None, address, port) for this attempt's Manager.

    torchft's Manager publishes its server's address in the group's store, which its other processes read. torchrun's
    store outlives a restart of the group, so a process of the new attempt could read the address of the dead
    attempt's server (and fail to connect for a minute, while the lighthouse waits for this group). With several
    processes, rank 0 of each attempt therefore serves a fresh store, named under the attempt's number in torchrun's.
    None, None: torchrun's own store (MASTER_ADDR/MASTER_PORT), which one process cannot misread."""
    if group_world == 1:
        return None, None, None
    from torch.distributed import TCPStore

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    key = f"accel_ft/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/store"
    shared = TCPStore(host, port, is_master=False, wait_for_workers=False)
    server = None
    if group_rank == 0:
        server = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        shared.set(key, f"{host}:{server.port}")
    addr, _, own_port = shared.get(key).decode().rpartition(":")
    return server, addr, int(own_port)


def _group_decides(wanted: bool, device: torch.device) -> bool:
    """Rank 0's `wanted`, on every rank of this group (a time-based decision must not split the group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return wanted
    flag = torch.tensor([1.0 if wanted else 0.0], device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _average_shards_over_replicas(manager, optimizer: torch.optim.Optimizer) -> None:
    """HSDP: each rank's gradient shards (FSDP2 reduced them inside the group) averaged with the same rank's of the
    other groups; a failure is reported to the Manager (the step is then not committed)."""
    grads = [_local(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    works = [manager.allreduce(grad) for grad in grads]
    for work in works:
        work.wait()


class _HealState:
    """What a replica group that heals receives from the same rank of a live one: everything save_state would save,
    captured and loaded by the same code (accel.checkpoint.training_state), and the position of the loader being
    iterated (batches handed out over every epoch): the group that heals moves its own loader on by the difference
    (across epochs), so the user's loop, unchanged, ends where the live groups' ends, with the batches of the steps
    that failed counted as theirs were."""

    def __init__(self, backend: FaultTolerantBackend, position: bool) -> None:
        self._backend = weakref.ref(backend)
        self._position = position

    def _objects(self):
        backend = self._backend()
        provider = backend.training_objects if backend is not None else None
        if provider is None:
            raise RuntimeError("fault tolerance: a heal needs the Accelerator's prepared objects; allowed: a backend "
                               "made by Accelerator()")
        return provider()

    def _loader(self):
        backend = self._backend()
        state = backend.gradient_state if backend is not None else None
        loader = state.active_dataloader if state is not None else None
        return loader if self._position and hasattr(loader, "fast_forward") else None

    def state_dict(self) -> dict:
        from accel.checkpoint.training_state import capture_state

        loader = self._loader()
        return {"state": capture_state(self._objects()),
                "batches": torch.tensor(-1 if loader is None else loader.batches_handed_out)}

    def load_state_dict(self, received: dict) -> None:
        from accel.checkpoint.training_state import restore_state

        loader, theirs = self._loader(), int(received["batches"])
        in_flight = () if loader is None else (loader, getattr(loader, "_parent", None))
        restore_state(self._objects(), received["state"], "fault tolerance: the state a live replica group sent",
                      in_flight)
        if loader is not None and theirs >= 0:
            loader.fast_forward(max(theirs - loader.batches_handed_out, 0))


def _commit_wrapper(run: FaultTolerantRun, optimizer: torch.optim.Optimizer, after_commit,
                    average_shards: bool = False) -> torch.optim.Optimizer:
    """torchft's Optimizer wrapper (step commits only when should_commit agrees; then `after_commit()`); zero_grad
    clears gradients only, as the quorum starts at the step's first forward."""
    from torchft.optim import OptimizerWrapper

    class CommittingOptimizer(OptimizerWrapper):
        def zero_grad(self, set_to_none: bool = True) -> None:
            self.optim.zero_grad(set_to_none)

        def step(self, closure: object | None = None) -> None:
            run.start_step()  # a step with no forward under autograd (nothing to all-reduce) still takes part
            if average_shards:
                _average_shards_over_replicas(run.manager, self.optim)
            before = run.manager.current_step()
            try:
                super().step(closure)
            finally:
                run.step_done()
            if run.manager.current_step() > before:
                after_commit()

    wrapped = CommittingOptimizer(run.manager, optimizer)
    wrapped.defaults = optimizer.defaults  # torch.optim.Optimizer's attributes that schedulers read
    # checkpoints name the user's optimizer class (as for ZeRO-1's wrapper), so they load without fault tolerance
    wrapped._optim_constructor = type(optimizer)
    return wrapped


@register_backend("fault_tolerant")
class FaultTolerantBackend(SpmdBackend):
    """Plain data parallelism inside each replica group, torchft's fault-tolerant all-reduce across the groups."""

    def __init__(self, *args, **kwargs) -> None:
        # the data-parallel plan (accel/parallel/data_parallel.py) reads the config's fault_tolerance section: with
        # ZeRO-2/3 and several processes per group, FSDP2 shards inside the group, the shards' gradients are averaged
        # over the groups (HSDP); otherwise DDP, even with one process per group (the groups all-reduce)
        super().__init__(*args, **kwargs)
        self.fault_tolerance: FaultToleranceConfig = self.config.fault_tolerance
        self._run: FaultTolerantRun | None = None
        self._semi_sync_models: list[torch.nn.Module] = []
        self._semi_sync: list = []  # torchft's LocalSGD/DiLoCo objects, entered (their optimizer hooks installed)
        self._checked_at = 0  # the committed step whose fingerprints were compared last
        self.state.add_release_callback(self._shutdown)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool = True) -> torch.nn.Module:
        prepared = super().prepare_model(model, device_placement)
        if self.data_parallel.fsdp and "_accel_ft_hooked" not in prepared.__dict__:
            prepared.register_forward_pre_hook(self._before_forward, prepend=True)  # before FSDP2 gathers
            prepared._accel_ft_hooked = True  # type: ignore[assignment]  # a plain attribute
        return prepared

    @property
    def run(self) -> FaultTolerantRun:
        """The Manager, made at the first prepare (every process of the group makes its own)."""
        if self._run is None:
            self._run = FaultTolerantRun(self.fault_tolerance, self.state.process_index, self.state.num_processes,
                                         self.state.device)
            self._run.register("training_state", _HealState(self, position=not self.semi_synchronous))
        return self._run

    def end_training(self) -> None:
        """The groups compare their weights once more at the end (unless the last committed step was compared)."""
        if self._run is not None and self.fault_tolerance.check_every and not self.semi_synchronous:
            self.check_replicas()

    def _shutdown(self) -> None:
        if self._run is not None:
            self._run.shutdown()

    # -- data: a shard among every process of every group (torchft's DistributedSampler's formula) -------------
    @property
    def data_parallel_size(self) -> int:
        return self.state.num_processes * self.fault_tolerance.group_size

    @property
    def data_parallel_rank(self) -> int:
        return self.state.process_index + self.state.num_processes * int(self.fault_tolerance.replica_id or 0)

    @property
    def replicated_state(self) -> bool:  # type: ignore[override]
        return not self.data_parallel.fsdp

    # -- model ----------------------------------------------------------------------------------------------
    def _wrap_ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        if not any(p.requires_grad for p in model.parameters()):
            return model
        run = self.run
        handler = find_handler(self.kwargs_handlers, DistributedDataParallelKwargs)
        if handler is not None and handler.comm_hook not in (None, "no"):
            raise ValueError("DistributedDataParallelKwargs(comm_hook=...) under fault tolerance: the gradients' "
                             "hook is torchft's all-reduce over the replica groups; allowed: comm_hook None")
        size = self.state.num_processes
        if self.semi_synchronous:  # the groups synchronise every sync_steps steps (torchft's LocalSGD/DiLoCo)
            self._semi_sync_models.append(model)
            if size == 1:
                return model
            group = self.topology.group(self.topology.gradient_dim, self.state.device.type)
            wrapped_in_group = apply_ddp(model, group, self.state.device, handler)  # plain DDP inside the group
            self._wrapped.append(weakref.ref(wrapped_in_group))
            return wrapped_in_group
        if size == 1:
            wrapped: torch.nn.Module = _fault_tolerant_ddp()(run.manager, model)
        else:
            options = dict(handler.to_kwargs()) if handler is not None else {}
            options.pop("comm_hook", None)
            options.pop("comm_state", None)
            group = self.topology.group(self.topology.gradient_dim, self.state.device.type)
            ours = DistributedDataParallelKwargs(**{k: v for k, v in options.items()
                                                    if k in DistributedDataParallelKwargs.__dataclass_fields__},
                                                 comm_hook=_group_then_replicas, comm_state=(run.manager, group, size))
            wrapped = apply_ddp(model, group, self.state.device, ours)
            self._wrapped.append(weakref.ref(wrapped))
        wrapped.register_forward_pre_hook(self._before_forward)
        return wrapped

    def _before_forward(self, module, args) -> None:
        if torch.is_grad_enabled():
            self.run.start_step()

    # -- optimizer --------------------------------------------------------------------------------------------
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, models: list) -> torch.optim.Optimizer:
        optimizer = super().prepare_optimizer(optimizer, models)
        if self.data_parallel.fsdp:
            return _commit_wrapper(self.run, optimizer, self._after_commit, average_shards=True)
        if self.semi_synchronous:
            self._semi_sync.append(self._semi_synchronise(optimizer))
            return optimizer
        return _commit_wrapper(self.run, optimizer, self._after_commit)

    # -- the groups hold the same weights: checked every check_every committed steps and at the end -------------
    def _after_commit(self) -> None:
        every, step = self.fault_tolerance.check_every, self.run.manager.current_step()
        if every and step % every == 0:
            self.check_replicas()

    def check_replicas(self) -> None:
        """Compare the groups' weight fingerprints now (every process of every live group calls this at the same
        committed step); a difference stops the job in one line (exit code 76, no restart)."""
        step = self.run.manager.current_step()
        if step == self._checked_at:
            return
        self._checked_at = step
        models: list = [self.unwrap_model(m) for m in self.training_objects().models] if self.training_objects else []
        found = fingerprint.difference(self.run.manager, models, int(self.fault_tolerance.replica_id or 0),
                                       self.state.device)
        found = fingerprint.agree_in_group(found, self.state.device)
        if found:
            fingerprint.stop(found, step, self.fault_tolerance.check_every)

    @property
    def semi_synchronous(self) -> bool:
        """The groups synchronise every `sync_steps` optimizer steps (semi_sync_method), not at every step."""
        return self.fault_tolerance.semi_sync_method is not None

    def _semi_synchronise(self, optimizer: torch.optim.Optimizer):
        """torchft's LocalSGD (the parameters averaged over the groups every sync_steps steps) or DiLoCo (the
        difference to the last synchronised parameters averaged, applied by an outer SGD with Nesterov momentum),
        installed on the optimizer's step hooks for the rest of the run."""
        from torchft.local_sgd import DiLoCo, LocalSGD

        owned = [m for m in self._semi_sync_models
                 if {id(p) for p in m.parameters()} & {id(p) for g in optimizer.param_groups for p in g["params"]}]
        if len(owned) != 1:
            raise ValueError("fault_tolerance.semi_sync_method: prepare exactly one model with each optimizer "
                             f"(found {len(owned)} prepared model(s) with this optimizer's parameters); allowed: "
                             "accelerator.prepare(model, optimizer)")
        model, ft = owned[0], self.fault_tolerance
        if ft.semi_sync_method == "local_sgd":
            sync: Any = LocalSGD(self.run.manager, model, optimizer, sync_every=ft.sync_steps)
        else:
            outer = torch.optim.SGD(model.parameters(), lr=ft.outer_lr, momentum=0.9, nesterov=True)
            sync = DiLoCo(self.run.manager, [model], optimizer, outer, sync_every=ft.sync_steps,
                          backup_device=self.state.device if self.state.device.type != "cpu" else None,
                          pin_memory=self.state.device.type == "cuda")
        sync.__enter__()
        return sync

    # -- checkpoints: the wrapped optimizer's state, with the Manager's beside it ------------------------------
    # torchft requires the Manager's state (its committed step count) in a checkpoint: it is saved with each optimizer
    # under "torchft" (plain numbers), and loaded back; the model and optimizer tensors are plain DDP's, so the
    # checkpoint loads under any other layout (a different number of groups or processes, no fault tolerance).
    def checkpoint_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        inner = getattr(optimizer, "optim", optimizer)  # torch's helpers step a stateless optimizer: not a commit
        return {**super().checkpoint_optimizer_state(model, inner), "torchft": self.run.manager.state_dict()}

    def load_checkpoint_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                        state: dict) -> None:
        state = dict(state)
        manager_state = state.pop("torchft", None)
        super().load_checkpoint_optimizer_state(model, getattr(optimizer, "optim", optimizer), state)
        if isinstance(manager_state, dict):
            self.run.manager.load_state_dict({k: int(v) for k, v in manager_state.items()})

    # -- what the job reports ---------------------------------------------------------------------------------
    @property
    def committed_steps(self) -> int:
        """Steps committed by the quorum (the same in every group once healed: it is part of what is sent)."""
        return self.run.manager.current_step()

