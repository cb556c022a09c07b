"""ParallelStyles torch does not ship: transformers' `Conv1D` (a linear layer whose weight is stored [in, out],
so column-wise is dimension 1 of the weight, not 0) and fused projections (q/k/v in one matrix: see fused.py).

They reuse torch's ColwiseParallel/RowwiseParallel input and output handling; only where the weight is cut
differs. The module's own forward runs on DTensors, as with nn.Linear.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from accel.backends import fused


def _distribute(module: nn.Module, mesh, placements: dict, src_data_rank, reorder=None) -> None:
    """Replace each parameter of `module` by a DTensor with `placements[name]` (after `reorder(name, tensor)`)."""
    for name, param in list(module.named_parameters(recurse=False)):
        data = param.detach() if reorder is None else reorder(name, param.detach())
        module.register_parameter(name, nn.Parameter(
            distribute_tensor(data, mesh, [placements[name]], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad))


class ColumnSplit(ColwiseParallel):
    """Column-wise split of a layer whose output features are dimension `out_dim` of its weight (0 for
    nn.Linear, 1 for Conv1D); with `parts` > 1 the output is several fused projections, reordered so that each
    rank holds a slice of every part (whole heads of q, k and v)."""

    def __init__(self, out_dim: int = 1, parts: int = 1, tp_size: int = 1, **layouts) -> None:
        super().__init__(**layouts)
        self.out_dim, self.parts, self.tp_size = out_dim, parts, tp_size

    def _reorder(self, name: str, tensor):
        dim = self.out_dim if name == "weight" else 0
        order = fused.permutation(tensor.shape[dim], self.parts, self.tp_size)
        return tensor.index_select(dim, order.to(tensor.device))

    def _partition(self, _name, module: nn.Module, mesh) -> None:
        _distribute(module, mesh, {"weight": Shard(self.out_dim), "bias": Shard(0)}, self.src_data_rank,
                    self._reorder if self.parts > 1 else None)
        if self.parts > 1:
            fused.mark(module, self.parts, self.tp_size, self.out_dim)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class TransposedRowwise(RowwiseParallel):
    """Row-wise split of transformers' Conv1D: the weight's input features are its dimension 0."""

    def _partition(self, _name, module: nn.Module, mesh) -> None:
        _distribute(module, mesh, {"weight": Shard(0), "bias": Replicate()}, self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class EmbeddingRowwise(RowwiseParallel):
    """torch's row-wise embedding (vocabulary split, partial sums all-reduced), with the all-reduce waited for in
    the output hook. torch's returns an AsyncCollectiveTensor; a compiled block that takes it as its input (Llama's
    first decoder layer under regional compilation) fails in backward ("'Tensor' object has no attribute
    '_local_tensor'", torch 2.13). Nothing runs between the embedding and its first use, so nothing is lost."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts)  # synchronous
        return outputs.to_local() if use_local_output else outputs
