"""Who this process is and how the processes of a run wait for, print through and take turns with each other:
the Accelerator's views of the process state, and the stop request every rank agrees on."""

from __future__ import annotations

from typing import Any, Callable

import torch

from accel.accelerator_mixins.fields import AcceleratorFields
from accel.runtime.state import DistributedType


class ProcessControl(AcceleratorFields):
    """The Accelerator's process identity and coordination, each answered by the one process state."""

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    @property
    def multi_device(self) -> bool:
        """Several accelerator devices (Accelerate's: MULTI_GPU and the like; not several CPU processes)."""
        return self.use_distributed and self.device.type != "cpu"

    def wait_for_everyone(self) -> None:
        self.state.wait_for_everyone()

    def print(self, *args, **kwargs) -> None:
        self.state.print(*args, **kwargs)

    def main_process_first(self):
        return self.state.main_process_first()

    def local_main_process_first(self):
        return self.state.local_main_process_first()

    def split_between_processes(self, inputs: Any, apply_padding: bool = False):
        return self.state.split_between_processes(inputs, apply_padding)

    def on_main_process(self, function: Callable | None = None) -> Callable:
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable | None = None) -> Callable:
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable) -> Callable:
        return self.state.on_last_process(function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        return self.state.on_process(function, process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        return self.state.on_local_process(function, local_process_index)

    @property
    def preemption_requested(self) -> bool:
        """True once the job was asked to stop (SIGTERM or `preemption_signal` to `accel launch`), on every process at
        the same step. Read it once per step on every rank (it is a tiny all_reduce): `if
        accelerator.preemption_requested: accelerator.save_state(); break`. See accel/runtime/preemption.py."""
        from accel.runtime import preemption

        return preemption.requested(self.state)
