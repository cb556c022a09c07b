"""Prepared loaders on torchdata's `StatefulDataLoader` (Accelerate's `use_stateful_dataloader=True`).

This module holds the mix-ins; `accel.data.loading.stateful_classes()` puts them on its loader classes (this
module imports nothing of accel, so the loaders depend on it and not the other way round). Their `state_dict()` also
holds the position inside the epoch (and the dataset's or workers' state where torchdata
can take it), so `load_state` resumes mid-epoch with no `skip_first_batches`. The position is taken when a batch is
handed to the loop, not when the one-ahead batch is read, so it counts exactly the batches the loop has seen.
"""

from __future__ import annotations

import warnings

from torchdata.stateful_dataloader import StatefulDataLoader

__all__ = ["DispatcherPosition", "Position", "SkipLoaderInit", "StatefulDataLoader"]


class Position:
    """The mix-in: the loader's epoch state (DataLoaderShard's) plus the base loader's position in the epoch."""

    _position = None
    _on_stateful_loader = True

    def __init__(self, *args, **kwargs):
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, which this torch deprecates
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            super().__init__(*args, **kwargs)

    def _snapshot(self) -> None:
        self._position = self._current_position()

    def _current_position(self):
        return StatefulDataLoader.state_dict(self)

    def _finish_epoch(self, epoch: int) -> None:
        super()._finish_epoch(epoch)  # type: ignore[misc]  # a mix-in: the loader class has it
        self._position = None  # the next pass starts a new epoch from its beginning

    def state_dict(self) -> dict:
        """torchdata's own state dict, as Accelerate's adapters return it: the position of the batches the loop was
        handed (equal to a bare `StatefulDataLoader`'s after the same batches); `load_state_dict` resumes from it."""
        return self._position if self._position is not None else StatefulDataLoader.state_dict(self)

    def _accel_state_dict(self) -> dict:
        """What `save_state` keeps: the loader's epoch state (DataLoaderShard's: epoch, seed, the shuffle's generator)
        and, mid-epoch, torchdata's position under "position"; `load_state_dict` takes it too."""
        state = super().state_dict()  # type: ignore[misc]  # a mix-in: the loader class has it
        if self._position is not None:
            state["position"] = self._position
        return state

    def _resumes_mid_epoch(self) -> bool:
        """A pass after loading a mid-epoch position continues that epoch (it draws nothing, see accel.data.loading)."""
        loaded, self._loaded_mid_epoch = self.__dict__.get("_loaded_mid_epoch", False), False
        return loaded or super()._resumes_mid_epoch()  # type: ignore[misc]  # a mix-in: the loader class has it

    def load_state_dict(self, state_dict: dict) -> None:
        if "iteration" in state_dict:  # accel's record (save_state): the epoch state, and the position inside it
            super().load_state_dict(state_dict)  # type: ignore[misc]  # a mix-in: the loader class has it
            self._position = state_dict.get("position")
        else:  # torchdata's state dict (`state_dict()`): the position in the current epoch
            self._position = state_dict
        self._loaded_mid_epoch = self._position is not None
        position = dict(self._position or {})
        if position.get("_iterator_finished"):  # saved after the epoch's last batch: resume at its end, where torchdata
            position["_iterator_finished"] = False  # would start the epoch over
        StatefulDataLoader.load_state_dict(self, position)


class DispatcherPosition(Position):
    """A `DataLoaderDispatcher`'s mix-in: the position saved is the main process's (the only one that reads), taken
    before the round that follows the handed-out batch is read."""

    def _base_position(self):
        return StatefulDataLoader.state_dict(self)

    def _current_position(self):
        return self._round_position  # taken before the next round was read: the rounds handed out so far


class SkipLoaderInit:
    """A `SkipDataLoader`'s mix-in: its `state_dict()` is torchdata's (the position counts the skipped batches too,
    as they were read)."""

    def __init__(self, *args, **kwargs):
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, which this torch deprecates
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            super().__init__(*args, **kwargs)
