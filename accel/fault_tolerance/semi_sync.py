"""Semi-synchronous training: Accelerate's `LocalSGD` (the `accelerate.local_sgd` path is this module).

Each process runs `local_sgd_steps` optimizer steps on its own, without reducing gradients (the model's backward
runs inside the data-parallel wrapper's `no_sync`), then every parameter is replaced by its mean over the
processes. As in Accelerate:

* `LocalSGD(accelerator, model, local_sgd_steps, enabled=True)` is a context manager; `step()` counts one step
  (call it after `optimizer.step()`, once per loop iteration, inside `accumulate` too) and averages the
  parameters every `local_sgd_steps` calls; leaving the block averages them once more.
* With one process (or `enabled=False`) nothing is averaged and `step()` only counts.
* Gradient accumulation composes: inside the LocalSGD block gradients are never reduced; `accumulate` only
  decides when the (prepared) optimizer steps.
* It is refused (NotImplementedError) where a process does not hold whole parameters: ZeRO, TP, pipeline stages,
  experts split over ranks (Accelerate refuses DeepSpeed, FSDP and Megatron-LM the same way).
* Under fault tolerance, semi-synchronous training over the replica groups is the config's
  `fault_tolerance.semi_sync_method` (`local_sgd` or `diloco`, every `sync_steps` steps, by torchft); a LocalSGD
  block in the script then only counts (each group's processes average their gradients at every step). Without
  semi_sync_method, LocalSGD under fault tolerance is refused in one line naming it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from accel.runtime.state import DistributedType

_REPLICATED_TYPES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class LocalSGD:
    """Run `local_sgd_steps` updates independently on each process, then average the model's parameters.

    >>> with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
    ...     for batch in loader:
    ...         with accelerator.accumulate(model):
    ...             accelerator.backward(model(**batch).loss)
    ...             optimizer.step()
    ...             optimizer.zero_grad()
    ...             local_sgd.step()
    """

    def __init__(self, accelerator: Any, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True):
        """`accelerator`: the Accelerator that prepared `model`; `local_sgd_steps`: optimizer steps between two
        averagings of the parameters; `enabled=False` turns LocalSGD off (then `step()` only counts)."""
        kind = accelerator.distributed_type
        backend = getattr(accelerator, "backend", None)
        whole = accelerator.num_processes <= 1 or bool(getattr(backend, "replicated_state", True))
        if kind not in _REPLICATED_TYPES or not whole:
            raise NotImplementedError("LocalSGD is supported only for CPUs and GPUs (no DeepSpeed or MegatronLM)"
                                      " and, in accel, only where every process holds whole parameters (DDP: no "
                                      "ZeRO, tensor, pipeline or expert parallelism)")
        if int(local_sgd_steps) < 1 and enabled:
            raise ValueError(f"LocalSGD: bad local_sgd_steps {local_sgd_steps!r}; allowed: an integer >= 1")
        over_groups = getattr(backend, "semi_synchronous", None)  # None: not under fault tolerance
        if over_groups is False and enabled and kind != DistributedType.NO:
            raise NotImplementedError("LocalSGD under fault tolerance: the replica groups all-reduce gradients at "
                                      "every step; set fault_tolerance.semi_sync_method: local_sgd or diloco "
                                      "(--ft_semi_sync_method) for semi-synchronous training over the groups")
        # under fault tolerance with semi_sync_method, torchft synchronises the groups (every sync_steps steps) and
        # DDP averages each group's gradients at every step: this block only counts
        self.enabled = enabled and kind != DistributedType.NO and not over_groups
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self.model_sync_obj: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self.model_sync_obj = self.accelerator.no_sync(self.model)
            self.model_sync_obj.__enter__()
        return self

    def __exit__(self, type, value, tb):
        if self.enabled:
            self._sync_and_avg_model_params()  # the processes leave the block with the same weights
            assert self.model_sync_obj is not None
            self.model_sync_obj.__exit__(type, value, tb)
            self.model_sync_obj = None

    def step(self) -> None:
        """Count one step; every `local_sgd_steps` steps, average the parameters over the processes."""
        self.num_steps += 1
        if not self.enabled:
            return
        if self.num_steps % self.local_sgd_steps == 0:
            self._sync_and_avg_model_params()

    def _sync_and_avg_model_params(self) -> None:
        """Every parameter becomes its mean over the processes (written in place: tied weights stay tied)."""
        self.accelerator.wait_for_everyone()
        with self.accelerator.autocast(), torch.no_grad():
            for param in self.model.parameters():
                param.data.copy_(self.accelerator.reduce(param.data, reduction="mean"))
