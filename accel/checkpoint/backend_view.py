"""What checkpoint code asks of a backend, as a typing Protocol.

The backends (accel/backends/) stand a floor above the checkpoint code, which therefore never imports them: it is
handed a backend and calls only these members on it. `accel.backends.base.Backend` has them all; a test's stand-in
needs no more.
"""

from __future__ import annotations

from typing import Protocol

import torch


class CheckpointBackend(Protocol):
    """The backend as `save_state`, `load_state` and a fault-tolerant heal use it."""

    @property
    def holds_part_of_model(self) -> bool:
        """True: each process has only some of the model's tensors (pipeline stages): the manifests are merged."""
        ...

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module inside the prepared one (its parameter names, without DDP's prefix)."""
        ...

    def checkpoint_model_state(self, model: torch.nn.Module) -> dict:
        """The model's (possibly sharded) state dict, keyed by the user's parameter names."""
        ...

    def checkpoint_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's (possibly sharded) state dict, keyed by the model's parameter names."""
        ...

    def load_checkpoint_model_state(self, model: torch.nn.Module, state: dict) -> None:
        """Put a state dict of `checkpoint_model_state`'s form into the model."""
        ...

    def load_checkpoint_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                        state: dict) -> None:
        """Put a state dict of `checkpoint_optimizer_state`'s form into the optimizer."""
        ...

    def held_names(self, for_optimizer: bool = False) -> set[str] | None:
        """The names whose model tensors (or optimizer state) this process loads; None: all of them."""
        ...

    def checkpoint_layouts(self, model: torch.nn.Module) -> dict[str, str]:
        """Parameters held in a layout of accel's own (TP's fused q/k/v): a checkpoint resumes only into the same."""
        ...
