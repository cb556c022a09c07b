"""The Accelerator's collectives: gather (for metrics: padding duplicates dropped), reduce, pad, the sequence loss's
reductions and the flag every process checks together."""

from __future__ import annotations

from typing import Any

import torch

from accel.accelerator_mixins.process import ProcessControl
from accel.runtime import ops


class Collectives(ProcessControl):
    """Operations every process takes part in (accel.runtime.ops), over the run's data-parallel group where a
    sample's processes share their data."""

    _trigger: torch.Tensor | None  # set_trigger's flag (absent before the first call)

    def gather(self, tensor: Any) -> Any:
        return ops.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather over the data-parallel processes, then drop the duplicates that padded the last batch, so
        each sample counts once. Processes that share a data shard (tensor- or pipeline-parallel ranks of one
        replica) hold the same samples: they are gathered once (use `gather` for every process's value)."""
        leaves: list = []
        ops.recursively_apply(leaves.append, input_data, test_type=lambda x: not isinstance(x, (list, tuple, dict)))
        all_tensors = all(isinstance(x, torch.Tensor) for x in leaves) and not isinstance(input_data, (str, int, float))
        replicas = self.backend.data_parallel_size
        group = self.topology.group("dp", self.device.type) if replicas < self.num_processes else None
        data: Any
        if use_gather_object or not all_tensors:
            items = input_data if isinstance(input_data, list) else [input_data]
            data = list(items) if replicas == 1 else ops.gather_object(items, group=group)
        else:  # with one replica, every process already holds all of it
            data = ops.gathered_alone(input_data) if replicas == 1 else ops.gather(input_data, group=group)
        remainder = self.gradient_state.remainder
        if self.gradient_state.end_of_dataloader and remainder > 0:
            if isinstance(data, list):
                return data[:remainder]
            return ops.recursively_apply(lambda t: t[:remainder], data)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return ops.reduce(tensor, reduction, scale)

    def shift_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The labels of a causal LM's loss computed from its logits: `labels` ([batch, sequence], e.g. the
        input_ids) shifted one token left, the last one -100. Under sequence or context parallelism (sp_size,
        cp_size), `labels` is this process's slice and the shift runs over the WHOLE sequence (the slices are
        gathered over the group), so each token of the slice gets the next token of the sequence; accel's padding is
        -100. With reduce_sequence_loss, the loss is one process's (docs/long_sequences.md)."""
        return self.backend.shift_labels(labels)

    def reduce_sequence_loss(self, loss_sum: torch.Tensor, num_tokens: torch.Tensor | int) -> torch.Tensor:
        """The mean loss over the tokens, from this process's summed token losses (e.g. cross_entropy(...,
        reduction="sum")) and its number of counted tokens. Under sequence or context parallelism it is the whole
        sequence's mean on every process (counts summed over the group), with gradients that equal one process's;
        else `loss_sum / num_tokens` (0 tokens: 0)."""
        return self.backend.reduce_token_loss(loss_sum, num_tokens)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        return ops.pad_across_processes(tensor, dim, pad_index, pad_first)

    def set_trigger(self) -> None:
        """Raise this process's flag; the next `check_trigger()` on every process sees it (e.g. to stop together)."""
        self._trigger = torch.ones((), device=self.device)

    def check_trigger(self) -> bool:
        """Whether any process called `set_trigger()` since the last check (all processes take part); the flags are
        cleared."""
        flag = getattr(self, "_trigger", None)
        flag = torch.zeros((), device=self.device) if flag is None else flag
        raised = bool(ops.reduce(flag, "sum").item() >= 1)
        self._trigger = None
        return raised
