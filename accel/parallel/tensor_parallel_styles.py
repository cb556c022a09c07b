"""ParallelStyles torch does not ship: transformers' `Conv1D` (a linear layer whose weight is stored [in, out],
so column-wise is dimension 1 of the weight, not 0), fused projections (q/k/v in one matrix: see fused.py) and a
MoE layer's stacked experts (`ExpertsSplit`).

They reuse torch's ColwiseParallel/RowwiseParallel input and output handling; only where the weight is cut
differs. The module's own forward runs on DTensors, as with nn.Linear.
"""

from __future__ import annotations

import types
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from accel.parallel import fused


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
            fused.mark(module, self.parts, self.tp_size, {"weight": self.out_dim, "bias": 0})

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


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the backward all-reduces the gradient over `group` (each rank's slice of the features
    gives a part of it). Megatron's "f"."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce forward (the ranks' partial sums); identity backward. Megatron's "g"."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ExpertsSplit(ParallelStyle):
    """A MoE layer's stacked experts (transformers' fused `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I],
    transformers' `moe_tp_experts`), split like a Megatron MLP within every expert. Each rank holds I/tp of the
    gate and of the up rows (reordered so a plain Shard holds both: fused.py) and the matching down columns. It
    runs every expert on all of its tokens, and the partial outputs are all-reduced. The module's own forward runs
    on the local tensors (a view of the module, as under expert parallelism). The inputs' gradients, tokens and
    router weights, are summed over the ranks."""

    def __init__(self, tp_size: int) -> None:
        super().__init__()
        self.tp_size = tp_size

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from accel.parallel.expert import local_view

        group = device_mesh.get_group()
        gate_up, down = module.get_parameter("gate_up_proj"), module.get_parameter("down_proj")
        order = fused.permutation(gate_up.shape[1], 2, self.tp_size).to(gate_up.device)
        reordered = gate_up.detach().index_select(1, order)
        for name, param, data, placement in (("gate_up_proj", gate_up, reordered, Shard(1)),
                                             ("down_proj", down, down.detach(), Shard(2))):
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(data, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))
        fused.mark(module, 2, self.tp_size, {"gate_up_proj": 1})
        original = type(module).forward
        routed = module.__dict__.get("forward")  # expert parallelism's all-to-all forward (it reads local rows)

        def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            hidden_states = _CopyToGroup.apply(hidden_states, group)
            top_k_weights = _CopyToGroup.apply(top_k_weights, group)
            if routed is not None:
                partial_sum = routed(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
            else:
                partial_sum = original(local_view(self), hidden_states, top_k_index, top_k_weights, *args, **kwargs)
            return _SumOverGroup.apply(partial_sum, group)

        module.forward = types.MethodType(forward, module)
        return module
