"""Which tokens of every sequence each sequence rank holds, and each rank's cut of a batch.

Two layouts over n ranks:

- **contiguous** (Ulysses, `sp_size`): rank r holds tokens [r*S/n, (r+1)*S/n). After attention's all-to-all every
  rank has whole sequences for some heads, in order.
- **balanced** (context parallelism, `cp_size`): the sequence is cut into 2n chunks and rank r holds chunks r and
  2n-1-r, so that under a causal mask every rank has the same attention work (Llama 3's and torch's head-tail
  load balancing).

The cut happens in the prepared DataLoader (`cut_batch`), after each data-parallel rank got its samples: the sequence
ranks of one data-parallel rank get the same samples and keep one slice each. Every tensor is cut as it is, labels
too: the prepared model's forward shifts the labels of a model that shifts them itself (transformers' causal LMs)
over the whole sequence (`shift_local_labels`), however they reached it (a dict, tuple, list or namedtuple batch, or
a labels= keyword built from any tensor), so the label of a slice's last token, which lives on the next slice, is not
lost. That is the one place labels are shifted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.distributed as dist

from accel.config.errors import ConfigError

IGNORE_INDEX = -100  # the label that no loss counts (torch's cross_entropy default, transformers' padding label)

# keys of a transformers-style batch that run along the sequence (dim 1), with the value padding extends them with
SEQUENCE_KEYS = {"input_ids": 0, "labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "attention_mask": 0,
                 "position_ids": None, "token_type_ids": 0, "inputs_embeds": 0.0, "loss_mask": 0}


class SequenceCutError(ConfigError):
    """A batch the sequence ranks cannot share (the message is one line: a ConfigError, so a launched job prints it
    once, on rank 0, without a traceback per rank)."""


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    degree: int
    rank: int
    balanced: bool  # head-tail chunks (cp) rather than contiguous slices (sp)

    @property
    def multiple(self) -> int:
        """Sequence lengths must be a multiple of this (a batch is padded up to one)."""
        return 2 * self.degree if self.balanced else self.degree

    def indices(self, length: int, rank: int | None = None, device=None) -> torch.Tensor:
        """The positions of the full sequence that `rank` (this rank by default) holds, in its local order."""
        rank = self.rank if rank is None else rank
        if not self.balanced:
            size = length // self.degree
            return torch.arange(rank * size, (rank + 1) * size, device=device)
        chunk = length // (2 * self.degree)
        head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
        tail_start = (2 * self.degree - 1 - rank) * chunk
        return torch.cat([head, torch.arange(tail_start, tail_start + chunk, device=device)])

    def gathered_indices(self, length: int, device=None) -> torch.Tensor:
        """The full-sequence positions of an all-gather of every rank's slice (rank 0's slice first)."""
        return torch.cat([self.indices(length, rank, device) for rank in range(self.degree)])

    def cut(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of a tensor that runs along the sequence on `dim`."""
        length = tensor.shape[dim]
        if not self.balanced:
            size = length // self.degree
            return tensor.narrow(dim, self.rank * size, size).contiguous()
        chunk = length // (2 * self.degree)
        tail = (2 * self.degree - 1 - self.rank) * chunk
        return torch.cat([tensor.narrow(dim, self.rank * chunk, chunk), tensor.narrow(dim, tail, chunk)], dim=dim)


REAL_LENGTH = "_accel_real_length"  # on the slices of a batch accel padded: the length before the padding


def shift_labels(labels: torch.Tensor, real_length: int | None = None) -> torch.Tensor:
    """Labels of the whole sequence moved one token left (the label of token t is the token t+1), the last one
    ignored: what a causal LM's loss computes from them. Tokens from `real_length` on (accel's padding) are ignored
    first, so the last real token does not predict a padding token, whatever tensor the labels were built from."""
    if real_length is not None and real_length < labels.shape[1]:
        labels = labels.clone()
        labels[:, real_length:] = IGNORE_INDEX
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def real_length(tensor) -> int | None:
    """The length before accel's padding of a slice cut from a padded batch (None: not padded by accel)."""
    return getattr(tensor, REAL_LENGTH, None) if isinstance(tensor, torch.Tensor) else None


def cut_batch(batch, layout: SequenceLayout, adds_positions: bool):
    """This rank's slice of a batch (see the module docstring).

    A dict batch (transformers style) has its sequence keys cut (`SEQUENCE_KEYS`, and any other tensor shaped like
    input_ids); it is first padded up to a multiple of `layout.multiple` (padding is masked out and its labels are
    ignored, so the loss and gradients are those of the unpadded batch; the slices remember the real length,
    `real_length`); position_ids are added when `adds_positions` (a transformers model computes them from the local
    length otherwise). A tuple or list (a namedtuple too) has each tensor whose dim 1 is the first tensor's length
    cut as it is (no padding: the length must divide). Labels are never shifted here: the prepared model's forward
    does it over the whole sequence. Anything else passes unchanged."""
    if isinstance(batch, Mapping):
        return _cut_mapping(batch, layout, adds_positions)
    if isinstance(batch, (tuple, list)):
        tensors = [t for t in batch if isinstance(t, torch.Tensor) and t.dim() >= 2]
        if not tensors:
            return batch
        length = tensors[0].shape[1]
        _check_length(length, layout, "the batch's first tensor")
        cut = [layout.cut(t) if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == length else t
               for t in batch]
        return type(batch)(cut) if isinstance(batch, list) else _same_tuple(batch, cut)
    if isinstance(batch, torch.Tensor) and batch.dim() >= 2:
        _check_length(batch.shape[1], layout, "the batch")
        return layout.cut(batch)
    return batch


def _same_tuple(batch: tuple, items: list):
    return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)


def _check_length(length: int, layout: SequenceLayout, what: str) -> None:
    if length % layout.multiple:
        name = "context" if layout.balanced else "sequence"
        raise SequenceCutError(
            f"{name} parallelism: {what} has sequence length {length}, which does not divide into "
            f"{layout.multiple} equal parts ({'2 x cp_size' if layout.balanced else 'sp_size'}); allowed: lengths that "
            f"are a multiple of {layout.multiple} (pad in the collator, e.g. pad_to_multiple_of={layout.multiple}), "
            "or a dict batch with input_ids, which accel pads")


def _cut_mapping(batch: Mapping, layout: SequenceLayout, adds_positions: bool):
    reference = batch.get("input_ids")
    if not isinstance(reference, torch.Tensor):
        reference = batch.get("inputs_embeds")
    if not isinstance(reference, torch.Tensor) or reference.dim() < 2:
        return batch
    size, length = reference.shape[:2]
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() != 2:
        raise SequenceCutError(
            f"sequence parallelism: attention_mask has {mask.dim()} dimensions; allowed: a 2-D padding mask (batch, "
            "sequence), or none (accel builds the causal, padding and packed-document masks across the ranks)")
    keys = [k for k, v in batch.items()
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[:2]) == (size, length)]
    out = dict(batch)
    if adds_positions and "position_ids" not in out:
        out["position_ids"] = torch.arange(length, device=reference.device).expand(size, length)
        keys.append("position_ids")
    padding = -length % layout.multiple
    if padding:
        if "attention_mask" not in out:
            out["attention_mask"] = torch.ones(size, length, dtype=torch.long, device=reference.device)
            keys.append("attention_mask")
        for key in keys:
            out[key] = _pad(key, out[key], padding)
    for key in keys:
        out[key] = layout.cut(out[key])
        if padding:  # the forward ignores the padding's labels, even of labels built from input_ids
            setattr(out[key], REAL_LENGTH, length)
    return type(batch)(out) if _rebuildable(batch) else out  # type: ignore[call-arg]  # dict-like types


def _pad(key: str, tensor: torch.Tensor, padding: int) -> torch.Tensor:
    if key == "position_ids":  # the padding continues the positions (it is masked out anyway)
        last = tensor[:, -1:]
        extra = last + torch.arange(1, padding + 1, device=tensor.device)
        return torch.cat([tensor, extra.to(tensor.dtype)], dim=1)
    value = SEQUENCE_KEYS.get(key) or 0
    shape = (tensor.shape[0], padding, *tensor.shape[2:])
    return torch.cat([tensor, torch.full(shape, value, dtype=tensor.dtype, device=tensor.device)], dim=1)


def _rebuildable(batch: Mapping) -> bool:
    """Whether the batch's own type can be rebuilt from a dict (a dict, transformers' BatchEncoding...)."""
    try:
        type(batch)({})  # type: ignore[call-arg]  # probing exactly that
    except Exception:  # noqa: BLE001 - any type that cannot: hand back a plain dict
        return False
    return True


def gather_slices(tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Every sequence rank's slice of `tensor` along `dim`, rank 0's first; differentiable: backward sums every
    rank's gradient of this rank's slice."""
    return _GatherSlices.apply(tensor, group, dim)


class _GatherSlices(torch.autograd.Function):
    """All-gather along `dim`; backward reduce-scatters (on gloo, which has none, an all-reduce and this rank's part;
    torch's differentiable all_gather emulates it with a scatter that names global ranks, which fails in a
    subgroup)."""

    @staticmethod
    def forward(ctx, tensor, group, dim):
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(tensor, memory_format=torch.contiguous_format)
                 for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        degree, dim = dist.get_world_size(ctx.group), ctx.dim
        part = grad.shape[dim] // degree
        if dist.get_backend(ctx.group) == "nccl":
            stacked = grad.movedim(dim, 0).contiguous()
            mine = torch.empty_like(stacked[:part])
            dist.reduce_scatter_tensor(mine, stacked, group=ctx.group)
            return mine.movedim(0, dim), None, None
        total = grad.contiguous()
        dist.all_reduce(total, group=ctx.group)
        return total.narrow(dim, dist.get_rank(ctx.group) * part, part), None, None

