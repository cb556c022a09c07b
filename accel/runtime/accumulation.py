"""Gradient-accumulation state: which step of the window we are on, and whether gradients sync now.

It knows nothing about backends: the Accelerator asks it `sync_gradients` and the backend decides what
"not syncing" means (DDP's `no_sync`, FSDP2's `set_requires_gradient_sync`, ...).
"""

from __future__ import annotations


class GradientState:
    """Shared by the Accelerator, the prepared optimizers/schedulers and the prepared data loaders.

    Each Accelerator builds its own (with its settings), which becomes the process's current one: Accelerate's
    `GradientState()`, without arguments, is that one (another object over the same attributes: a setting changed
    through the Accelerator is seen there), or a new one with the defaults where there is none yet (a loader built
    without an Accelerator). `_reset_state()` forgets the current one; the objects that hold it keep it.
    """

    _shared_state: dict = {}  # the current state's attributes ({} before any, and after _reset_state)

    def __init__(self, num_steps: int | None = None, sync_with_dataloader: bool | None = None,
                 adjust_scheduler: bool | None = None, sync_each_batch: bool | None = None):
        settings = (num_steps, sync_with_dataloader, adjust_scheduler, sync_each_batch)
        if all(value is None for value in settings) and GradientState._shared_state:
            self.__dict__ = GradientState._shared_state  # Accelerate's GradientState(): the current one
            return
        self.num_steps = 1 if num_steps is None else num_steps
        self.sync_each_batch = bool(sync_each_batch)
        self.sync_with_dataloader = True if sync_with_dataloader is None else sync_with_dataloader
        self.adjust_scheduler = True if adjust_scheduler is None else adjust_scheduler
        self._sync_gradients = True
        self._windowed = False  # set once the loop decides which micro-steps sync: accumulate(), or itself
        self._noted = False
        self.step = 0
        self.dataloader_references: list = []  # stack of loaders being iterated (innermost last)
        GradientState._shared_state = self.__dict__

    @property
    def sync_gradients(self) -> bool:
        return self._sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self._sync_gradients = value
        self._windowed = True

    def unwindowed_note(self) -> str | None:
        """At an optimizer step: once, when num_steps > 1 but the loop never entered `accumulate()` (nor set
        sync_gradients itself), why its numbers differ: backward still divides each loss by num_steps, as Accelerate
        does, and every batch steps. None otherwise."""
        if self.num_steps <= 1 or self._windowed or self._noted:
            return None
        self._noted = True
        n = self.num_steps
        return (f"accel: gradient_accumulation_steps is {n} but the loop reached its first optimizer step without "
                f"entering accelerator.accumulate(): as in Accelerate, backward divides each loss by {n} and the "
                f"optimizer steps on every batch; wrap each step in `with accelerator.accumulate(model):` to "
                f"accumulate {n} batches, or set gradient_accumulation_steps to 1 (`accel launch`'s start line and "
                f"`accel env` show where it was set)")

    @classmethod
    def _reset_state(cls) -> None:
        """Accelerate's name (its test helpers call it between tests): forget the current state, so the next
        `GradientState()` starts a new one (the objects holding the old one keep it)."""
        GradientState._shared_state = {}

    # -- data loaders report their iteration here -------------------------------------------------------
    def _add_dataloader(self, loader) -> None:
        self.dataloader_references.append(loader)

    def _remove_dataloader(self, loader) -> None:
        if loader in self.dataloader_references:
            self.dataloader_references.remove(loader)

    @property
    def active_dataloader(self):
        return self.dataloader_references[-1] if self.dataloader_references else None

    @property
    def in_dataloader(self) -> bool:
        return self.active_dataloader is not None

    @property
    def end_of_dataloader(self) -> bool:
        loader = self.active_dataloader
        return bool(loader is not None and loader.end_of_dataloader)

    @property
    def remainder(self) -> int:
        """Real samples in the last global batch (-1 when unknown or not at the end)."""
        loader = self.active_dataloader
        return -1 if loader is None else loader.remainder

    @property
    def plugin_kwargs(self) -> dict:
        """Accelerate's view of the settings: those that differ from `GradientAccumulationPlugin()`'s defaults
        (transformers' Trainer reads `sync_each_batch` here)."""
        given = {"num_steps": self.num_steps, "adjust_scheduler": self.adjust_scheduler,
                 "sync_with_dataloader": self.sync_with_dataloader, "sync_each_batch": self.sync_each_batch}
        defaults = {"num_steps": None, "adjust_scheduler": True, "sync_with_dataloader": True, "sync_each_batch": False}
        return {key: value for key, value in given.items() if value != defaults[key]}

    @property
    def initialized(self) -> bool:
        """Accelerate's flag for a state set up by an Accelerator; each Accelerator builds its own here."""
        return True

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """Accelerate's setter: a loop that decides the window itself (transformers' Trainer prefetches the window's
        batches) says here whether this micro-step syncs; the optimizer, scheduler and `no_sync` follow it."""
        self.sync_gradients = bool(sync_gradients)

    # -- the accumulation window -------------------------------------------------------------------------
    def do_sync_step(self) -> bool:
        """Advance one micro-step (Accelerate's `_do_sync`) and return whether gradients sync on it."""
        if self.sync_with_dataloader and self.end_of_dataloader:
            self.step = 0
            self.sync_gradients = True
        else:
            self.step += 1
            self.sync_gradients = (self.step % self.num_steps) == 0
        return self.sync_gradients


class GradientAccumulationPlugin:
    """Accelerate's `GradientAccumulationPlugin(num_steps, adjust_scheduler, sync_with_dataloader)`."""

    def __init__(self, num_steps: int | None = None, adjust_scheduler: bool = True, sync_with_dataloader: bool = True,
                 sync_each_batch: bool = False) -> None:
        self.sync_each_batch = sync_each_batch  # reduce gradients on every micro-batch (less memory with sharding)
        self.num_steps = num_steps
        self.adjust_scheduler = adjust_scheduler
        self.sync_with_dataloader = sync_with_dataloader

    def to_dict(self) -> dict:
        """Every attribute, as Accelerate's KwargsHandler.to_dict."""
        return dict(vars(self))

    def to_kwargs(self) -> dict:
        """The attributes that differ from the defaults, as Accelerate's KwargsHandler.to_kwargs."""
        defaults = vars(GradientAccumulationPlugin())
        return {k: v for k, v in vars(self).items() if defaults.get(k) != v}
