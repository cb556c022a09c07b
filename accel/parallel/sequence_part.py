"""Sequence (sp_size, Ulysses) and context (cp_size) parallelism as a part: the prepared DataLoaders hand each
rank its slice of every sequence, the prepared model's attention runs over the whole sequence, and losses are
reduced to the whole sequence's (sequence.py, sequence_layout.py)."""

from __future__ import annotations

import torch

from accel.parallel.part import Part
from accel.parallel.sequence_layout import IGNORE_INDEX, real_length


class SequencePart(Part):
    name = "sequence"
    title = "sequence or context parallelism"
    cuts_batches = True

    def __init__(self, topology, state, parallelism, data_parallel) -> None:
        self.topology, self.state, self.parallelism = topology, state, parallelism
        self._group = None  # the SequenceParallel of this job, built on first use (by every rank)

    def __getstate__(self) -> dict:
        """A pickled copy owns no process groups."""
        return {**self.__dict__, "_group": None}

    @property
    def group(self):
        """The sequence group's layout, attention, batch cut and loss (sequence.SequenceParallel)."""
        if self._group is None:
            from accel.parallel.sequence import SequenceParallel

            self._group = SequenceParallel(self.topology, self.state, self.parallelism)
        return self._group

    def cut_batch(self, batch):
        return self.group.cut_batch(batch)

    def install(self, model: torch.nn.Module) -> None:
        self.group.install(model)

    def note_loss_fn(self, loss_fn) -> None:
        """With a loss function, a forward without labels is not a loss accel misses: `reduce_loss` reduces it."""
        self.group.loss_fn_given = loss_fn is not None

    def reduce_loss(self, loss: torch.Tensor, target) -> torch.Tensor:
        """The whole sequence's mean loss, weighted by each slice's counted tokens when the target is labels."""
        counted = isinstance(target, torch.Tensor) and not target.is_floating_point()
        return self.group.reduce_loss(loss, (target != IGNORE_INDEX).sum() if counted else None)

    def reduce_token_loss(self, loss_sum: torch.Tensor, num_tokens) -> torch.Tensor:
        return self.group.reduce_token_loss(loss_sum, num_tokens)

    def shift_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return self.group.shift_labels(labels, real=real_length(labels))
