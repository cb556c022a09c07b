"""Sequence parallelism (Ulysses, `sp_size`) and context parallelism (`cp_size`): the ranks of one sequence group
share every batch, each holding a slice of each sequence (`sequence_layout`), so activations per rank shrink by the
degree. Everything but attention works token by token and needs no change; attention needs every token:

- **Ulysses** (sp): before attention an all-to-all turns the sequence-sharded q/k/v (all heads) into head-sharded
  full sequences (heads / sp each), any attention kernel runs on them, and an all-to-all turns the output back.
  Heads (key/value heads too) must divide by sp_size.
- **Context parallelism** (cp, `cp_comm_strategy: allgather`): each rank keeps its queries and all-gathers K and V
  from the cp ranks (Llama 3's scheme); the mask is built for its load-balanced chunks. With `ring` on CUDA, torch's
  ring attention (`context_parallel`'s) runs instead where it applies: SDPA with a causal mask or none.

Masks are built here from the whole sequence's `attention_mask` (padding) and `position_ids` (packed documents:
a position that does not follow its predecessor starts a document), all-gathered over the group: causal x padding x
same-document, never dropped. transformers models get this through their attention-function registry; a module of
the user's through `torch.nn.functional.scaled_dot_product_attention` (patched while accel runs sequence parallel).

The loss: a model's loss on a slice is the mean over that slice's tokens. `reduce_loss` turns it into the mean over
the whole sequence's tokens (counts all-reduced over the group), on every rank, with gradients that make the
data-parallel average over dp x sp equal one process on the full sequence. The labels of a model that shifts them
(causal LMs) are shifted in the wrapped forward over the whole sequence (gathered over the group, shifted, this
rank's positions kept), however they arrive: the loader cuts them as they are. A loss the user computes from the
logits gets the same from `shift_labels` and `reduce_token_loss` (Accelerator.shift_labels and
Accelerator.reduce_sequence_loss).
"""

from __future__ import annotations

import dataclasses
import inspect
import contextlib
import sys
import warnings
import weakref
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from accel.parallel.sequence_layout import IGNORE_INDEX, SequenceLayout, cut_batch, gather_slices, real_length
from accel.parallel.sequence_layout import shift_labels as shift_whole_labels
from accel.parallel.sequence_router_loss import LOSS_FUNCTION, computes_router_loss, excess, whole_sequence
from accel.config.errors import ConfigError

_ORIGINAL_SDPA = torch.nn.functional.scaled_dot_product_attention
_PLAIN: weakref.ref | None = None  # the SequenceParallel of the last prepared module of the user's (SDPA's patch)
_KERNEL_DEPTH = [0]  # above 0 while accel's own attention runs a kernel: its SDPA calls are whole-sequence already


@dataclasses.dataclass
class StepContext:
    """The whole sequence's mask information for the current forward (global token order)."""

    length: int
    key_padding: torch.Tensor | None = None  # [batch, length] bool: True for a real token
    documents: torch.Tensor | None = None  # [batch, length] long: the packed document of each token

    def needs_mask(self) -> bool:
        return self.key_padding is not None or self.documents is not None

    def allowed(self, q_index: torch.Tensor, k_index: torch.Tensor, causal: bool) -> torch.Tensor:
        """[batch or 1, 1, queries, keys] bool: which keys each query attends to. A query that would attend to
        nothing (a padding token under left padding) attends to itself, so no row is empty (its output is unused)."""
        allowed = torch.ones(1, 1, len(q_index), len(k_index), dtype=torch.bool, device=q_index.device)
        if causal:
            allowed = allowed & (k_index[None, :] <= q_index[:, None])[None, None]
        if self.key_padding is not None:
            allowed = allowed & self.key_padding[:, k_index][:, None, None, :]
        if self.documents is not None:
            docs_q = self.documents[:, q_index][:, None, :, None]
            docs_k = self.documents[:, k_index][:, None, None, :]
            allowed = allowed & (docs_q == docs_k)
        return allowed | (q_index[:, None] == k_index[None, :])[None, None]


def documents_from_positions(positions: torch.Tensor) -> torch.Tensor | None:
    """Packed sequences: a new document starts wherever a position does not follow its predecessor (transformers'
    convention for packing without padding). None when every row is one document."""
    starts = positions[:, 1:] != positions[:, :-1] + 1
    if not bool(starts.any()):
        return None
    return torch.nn.functional.pad(starts.long(), (1, 0)).cumsum(dim=1)


def kind_name(kind: str) -> str:
    """How messages name a sequence group's kind: "sequence parallelism" (sp) or "context parallelism" (cp)."""
    return "sequence parallelism" if kind == "sp" else "context parallelism"


class SequenceParallel:
    """The sequence group of one job: its layout, the batch cut, the attention and the loss reduction."""

    def __init__(self, topology, state, parallelism) -> None:
        self.kind = topology.seq_name  # "sp" (Ulysses) or "cp"
        self.degree = topology.seq_size
        self.tp_size = topology.tp_size
        device_type = state.device.type
        self.group = topology.group(self.kind, device_type)
        self.mesh = topology.submesh(self.kind, device_type)
        self.layout = SequenceLayout(self.degree, topology.seq_rank(state.process_index), balanced=self.kind == "cp")
        self.ring = getattr(parallelism, "cp_comm_strategy", "allgather") == "ring" and self.kind == "cp"
        handler = getattr(parallelism, "sp_handler", None)  # Accelerate 1.16's DeepSpeedSequenceParallelConfig
        self.allow_recurrent = bool(getattr(handler, "sp_allow_recurrent_layers", False))
        # pipeline stages run several micro-batches' forwards before their backwards: a layer recomputed in backward
        # (activation checkpointing) would see the latest micro-batch's mask (`context`)
        self.recomputes_across_microbatches = getattr(topology, "pp_size", 1) > 1 and \
            getattr(parallelism, "activation_checkpointing", "no") not in (None, "no", False)
        self.shifts_labels = False  # set when a model that shifts its labels (a causal LM) is prepared
        self.adds_positions = False  # set when a transformers model (positions from the local length) is prepared
        self.context: StepContext | None = None  # kept after forward: activation checkpointing recomputes in backward
        self._in_forward = False
        self._warned_no_labels = False
        self.loss_fn_given = False  # prepare's loss_fn computes the loss from the outputs (reduce_loss reduces it)

    # -- data -------------------------------------------------------------------------------------------------
    def cut_batch(self, batch):
        """This rank's slice of a batch (the prepared DataLoader's last step)."""
        return cut_batch(batch, self.layout, self.adds_positions)

    # -- model ------------------------------------------------------------------------------------------------
    def install(self, model: torch.nn.Module) -> None:
        """Make `model`'s attention and loss sequence-parallel (once per model)."""
        if "_accel_sequence_forward" in model.__dict__:
            return
        config = getattr(model, "config", None)
        transformers_model = config is not None and hasattr(config, "_attn_implementation")
        if transformers_model:
            self._refuse_recurrent_layers(model, config)
            self._refuse_router_loss(model, config)
            self._check_heads(config)
            self._use_registry(model, config)
            self.adds_positions = True
            self.shifts_labels = self.shifts_labels or _shifts_labels(model)
        else:
            self._patch_sdpa()
        if self.ring and torch.cuda.is_available():
            from torch.distributed.tensor.experimental._context_parallel._attention import (
                _enable_cp_dtensor_dispatcher,
            )

            _enable_cp_dtensor_dispatcher()  # torch's ring attention for SDPA on DTensors sharded on the sequence
        self._wrap_forward(model, transformers_model)

    def _refuse_recurrent_layers(self, model: torch.nn.Module, config) -> None:
        """Linear-attention (recurrent) layers carry a state along the sequence outside the attention function: cut
        over ranks, each rank restarts it and the gradients are wrong without any error (Accelerate 1.16 refuses
        them too, unless `DeepSpeedSequenceParallelConfig(sp_allow_recurrent_layers=True)`)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        recurrent = sorted({t for t in getattr(text, "layer_types", None) or () if "linear_attention" in str(t)})
        if recurrent and not self.allow_recurrent:
            raise ConfigError(
                f"{kind_name(self.kind)}: {type(model).__name__} has attention "
                f"layers of type {recurrent} ({type(text).__name__}.layer_types), whose recurrent state would restart "
                f"on every {self.kind} rank and give wrong gradients; allowed: a full-attention model, "
                f"{self.kind}_size 1, or ParallelismConfig(sp_handler=DeepSpeedSequenceParallelConfig("
                "sp_allow_recurrent_layers=True)) for a model that passes that state between the ranks itself")

    def _refuse_router_loss(self, model: torch.nn.Module, config, in_forward: bool = False) -> None:
        """A MoE model's router auxiliary (load-balancing) loss is a product of means over all tokens: computed on
        each rank's slice and added to the slice's loss, the loss would count it once per rank and its gradient would
        not be the whole sequence's (tiny Mixtral, sp 2: 4.592 against one process's 4.392, no error). A model whose
        modeling module has transformers' `load_balancing_loss_func` gets it over the whole sequence
        (sequence_router_loss.py); another is refused."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if not (in_forward or getattr(text, "output_router_logits", False)) or \
                not getattr(text, "router_aux_loss_coef", 0) or computes_router_loss(model):
            return
        where = "forward's output_router_logits" if in_forward else f"{type(text).__name__}.output_router_logits"
        raise ConfigError(
            f"{kind_name(self.kind)}: {type(model).__name__} adds its router's "
            f"auxiliary loss ({where}=True, router_aux_loss_coef="
            f"{text.router_aux_loss_coef}), which each {self.kind} rank would compute on its slice only (counted "
            f"{self.kind}_size times, a gradient that is not the whole sequence's), and its modeling module has no "
            f"{LOSS_FUNCTION} to compute it over the whole sequence; allowed: output_router_logits False or "
            f"router_aux_loss_coef 0, or {self.kind}_size 1")

    def _check_heads(self, config) -> None:
        if self.kind != "sp":
            return
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if count is not None and count % (self.degree * self.tp_size):
                tp = f" x tp_size={self.tp_size}" if self.tp_size > 1 else ""
                raise ConfigError(
                    f"sequence parallelism: sp_size={self.degree}{tp} does not divide the model's {name}={count} "
                    f"({type(config).__name__}): Ulysses splits the heads over the sp ranks; allowed: an sp_size that "
                    f"divides {count}{' / tp_size' if tp else ''}, or cp_size (context parallelism splits the sequence "
                    "instead of the heads)")

    def _use_registry(self, model: torch.nn.Module, config) -> None:
        from transformers import AttentionInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        original = config._attn_implementation or "eager"
        if original.startswith("accel_"):
            return
        base = None if original == "eager" else ALL_ATTENTION_FUNCTIONS[original]
        name = f"accel_{self.kind}_{original}"
        sequence = self

        def attention(module, query, key, value, attention_mask, **kwargs):
            kernel = base if base is not None else _eager_attention(module)
            return sequence.transformers_attention(kernel, original, module, query, key, value, **kwargs)

        AttentionInterface.register(name, attention)
        config._attn_implementation = name
        for module in model.modules():  # a pipeline stage's copy of the model: its layers keep the user's config
            other = getattr(module, "config", None)
            if other is not None and other is not config and getattr(other, "_attn_implementation", None) == original:
                other._attn_implementation = name

    def _patch_sdpa(self) -> None:
        global _PLAIN
        _PLAIN = weakref.ref(self)
        torch.nn.functional.scaled_dot_product_attention = _sequence_parallel_sdpa

    def active(self) -> bool:
        """Inside a prepared model's forward, or in a backward that recomputes one (activation checkpointing)."""
        return self.context is not None and (self._in_forward or torch._C._current_graph_task_id() != -1)

    def _wrap_forward(self, model: torch.nn.Module, transformers_model: bool) -> None:
        inner = model.forward
        parameters = inspect.signature(inner).parameters
        accepts_kwargs = transformers_model and hasattr(model, "loss_function") and any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        takes_labels = transformers_model and "labels" in parameters
        sequence = self

        def forward(*args, **kwargs):
            reference = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
            if not isinstance(reference, torch.Tensor) or reference.dim() < 2:
                return inner(*args, **kwargs)
            length = reference.shape[1] * sequence.degree
            if sequence.adds_positions and kwargs.get("position_ids") is None:
                positions = sequence.layout.indices(length, device=reference.device)
                kwargs["position_ids"] = positions.expand(reference.shape[0], -1)
            sequence.context = sequence._context(length, kwargs.get("attention_mask"), kwargs.get("position_ids"))
            if sequence.context.needs_mask() and sequence.recomputes_across_microbatches:
                raise ConfigError(
                    f"{kind_name(sequence.kind)} with pipeline stages and activation checkpointing: a padding or "
                    "packed-document mask would be recomputed in backward with another micro-batch's mask; allowed: "
                    "batches without padding or packing, or activation_checkpointing 'no'")
            labels = kwargs.get("labels")
            if transformers_model and kwargs.get("output_router_logits") and isinstance(labels, torch.Tensor):
                sequence._refuse_router_loss(model, model.config, in_forward=True)
            if takes_labels and labels is None and kwargs.get("shift_labels") is None and not sequence.loss_fn_given:
                sequence._warn_no_labels(type(model).__name__)
            summed = False
            count = None
            if isinstance(labels, torch.Tensor):
                given = kwargs.get("shift_labels")
                if isinstance(given, torch.Tensor):  # shifted by the user over the whole sequence: not again
                    kwargs["shift_labels"] = sequence.local_part(given, reference.shape[1], "shift_labels")
                elif sequence.shifts_labels:
                    if not accepts_kwargs:
                        raise ConfigError(
                            f"{kind_name(sequence.kind)}: "
                            f"{type(model).__name__}.forward takes no shift_labels (no **kwargs), so its loss would "
                            f"lose the last label of every slice; allowed: a model whose forward passes **kwargs to "
                            f"its loss_function, or its logits with accelerator.shift_labels and "
                            f"accelerator.reduce_sequence_loss, or {sequence.kind}_size 1")
                    kwargs["shift_labels"] = sequence.shift_labels(labels, reference.shape[1],
                                                                   real_length(reference) or real_length(labels))
                count = (kwargs.get("shift_labels", labels) != IGNORE_INDEX).sum()
                if accepts_kwargs and "num_items_in_batch" not in kwargs:
                    kwargs["num_items_in_batch"] = sequence.all_reduce(count.clone())  # the slice's loss is S/N
                    summed = True
            sequence._in_forward = True
            try:
                with whole_sequence(model, sequence.group, reference.shape[0]):
                    outputs = inner(*args, **kwargs)
            finally:
                sequence._in_forward = False
            loss = _loss_of(outputs)
            if loss is not None and isinstance(labels, torch.Tensor):
                given_back = excess(model, outputs, sequence.degree) if summed else None
                if given_back is not None:  # the router term is the same on every rank: the sum counts it once
                    loss = loss - given_back.to(loss.device)
                reduced = sequence.reduce_loss(loss, None if summed else count, summed=summed)
                outputs = _with_loss(outputs, reduced)
            return outputs

        model.forward = forward
        model._accel_sequence_forward = inner  # type: ignore[assignment]  # a plain attribute: the model's own

    def _warn_no_labels(self, name: str) -> None:
        """Once per job, on rank 0: a loss computed from this forward's logits is not the whole sequence's unless it
        uses shift_labels and reduce_sequence_loss."""
        if self._warned_no_labels:
            return
        self._warned_no_labels = True
        if dist.get_rank() == 0:
            warnings.warn(
                f"{self.kind}_size={self.degree}: {name} was called without labels, so accel cannot make its loss the "
                "whole sequence's; for a loss computed from its logits use labels = accelerator.shift_labels("
                "input_ids) and loss = accelerator.reduce_sequence_loss(loss_sum, num_tokens) (docs/long_sequences.md"
                "), else the numbers differ from one process", stacklevel=3)

    def local_part(self, labels: torch.Tensor, local: int, what: str = "labels") -> torch.Tensor:
        """This rank's slice of a [batch, sequence] tensor given either as the slice (`local` long: as it is) or as
        the whole sequence (cut here)."""
        if labels.dim() >= 2 and labels.shape[1] == local:
            return labels
        if labels.dim() >= 2 and labels.shape[1] == local * self.degree:
            return self.layout.cut(labels)
        raise ConfigError(
            f"{kind_name(self.kind)}: {what} of shape {tuple(labels.shape)} "
            f"with input_ids of {local} tokens per {self.kind} rank; allowed: {what} of this rank's {local} tokens "
            f"(cut by the prepared DataLoader with the inputs) or of the whole sequence's {local * self.degree}")

    def shift_labels(self, labels: torch.Tensor, local: int | None = None, real: int | None = None) -> torch.Tensor:
        """This rank's slice of the labels shifted one token left over the WHOLE sequence: `labels` is this rank's
        slice (gathered over the group here) or the whole sequence; `real` the length before accel's padding."""
        local = labels.shape[1] if local is None else local
        if labels.dim() >= 2 and labels.shape[1] == local and self.degree > 1:
            labels = self.whole(labels)
        elif labels.dim() < 2 or labels.shape[1] != local * self.degree:
            labels = self.local_part(labels, local)  # refused in one line
        return self.layout.cut(shift_whole_labels(labels, real))

    def _context(self, length: int, attention_mask, positions) -> StepContext:
        context = StepContext(length)
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            padding = self.whole(attention_mask)
            if not bool(padding.all()):
                context.key_padding = padding.bool()
        if isinstance(positions, torch.Tensor) and positions.dim() == 2:
            context.documents = documents_from_positions(self.whole(positions))
        return context

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        """The whole sequence, in order, of a [batch, slice] tensor (all-gathered over the group; no gradient)."""
        parts = [torch.empty_like(local) for _ in range(self.degree)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        gathered = torch.cat(parts, dim=1)
        whole = torch.empty_like(gathered)
        whole[:, self.layout.gathered_indices(gathered.shape[1], device=local.device)] = gathered
        return whole

    # -- attention --------------------------------------------------------------------------------------------
    def transformers_attention(self, kernel, kernel_name: str, module, query, key, value, **kwargs):
        """A transformers attention function's contract: q/k/v [batch, heads, slice, dim] in, ([batch, slice, heads,
        dim], None) out; `kernel` is the model's own implementation (eager, sdpa, flash...)."""
        kwargs.pop("is_causal", None)
        causal = bool(getattr(module, "is_causal", True))
        eager = kernel_name == "eager"

        def run(q, k, v, mask, is_causal):
            if mask is not None and eager:  # eager adds the mask to the scores
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, torch.finfo(
                    q.dtype).min)
            elif mask is None and is_causal and eager:
                index = torch.arange(q.shape[2], device=q.device)
                return run(q, k, v, StepContext(q.shape[2]).allowed(index, index, True), False)
            elif mask is not None and kernel_name not in ("sdpa",):
                raise ValueError(f"sequence parallelism: attention implementation {kernel_name!r} with a padding or "
                                 "packed-document mask; allowed: attn_implementation 'sdpa' or 'eager' with masks")
            out, _ = kernel(module, q, k, v, mask, is_causal=is_causal, **kwargs)
            return out.transpose(1, 2)  # [batch, heads, sequence, dim]

        out = self.attention(query, key, value, causal, run, sdpa=not eager)
        return out.transpose(1, 2).contiguous(), None

    def attention(self, query, key, value, causal: bool, kernel, sdpa: bool):
        """Attention over the whole sequence from this rank's slice of q/k/v ([batch, heads, slice, dim]); `kernel(q,
        k, v, mask, is_causal)` is the attention to run, its mask a [batch, 1, q, k] bool or None."""
        with _in_kernel():
            return self._attention(query, key, value, causal, kernel, sdpa)

    def _attention(self, query, key, value, causal: bool, kernel, sdpa: bool):
        context = self.context or StepContext(query.shape[2] * self.degree)
        length = context.length
        if self.kind == "sp":
            q, k, v = (self.sequence_to_heads(t) for t in (query, key, value))
            if not context.needs_mask() and sdpa:
                out = kernel(q, k, v, None, causal)
            else:
                index = torch.arange(length, device=query.device)
                out = kernel(q, k, v, context.allowed(index, index, causal), False)
            return self.heads_to_sequence(out)
        if self.ring and query.is_cuda and sdpa and causal and not context.needs_mask():
            return self._ring_attention(query, key, value)
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in (query, key, value)):
            return self._gathered_attention(query, key, value, causal, kernel, context)
        # what backward needs is recomputed there (the all-gather too) rather than saved: the whole sequence's K and V
        # and the masks would otherwise stay in memory per layer until backward, and a rank would hold far more than
        # 1/cp of one process's activations (measured 1.40x of 1/2 at cp 2 with them saved)
        return torch.utils.checkpoint.checkpoint(self._gathered_attention, query, key, value, causal, kernel, context,
                                                 use_reentrant=False)

    def _gathered_attention(self, query, key, value, causal: bool, kernel, context: StepContext):
        """cp all-gather: this rank's queries against the whole sequence's keys and values."""
        with _in_kernel():  # also when checkpoint recomputes it in backward, outside `attention`
            length = context.length
            keys, values = self.gather_sequence(key), self.gather_sequence(value)
            order = torch.argsort(self.layout.gathered_indices(length, device=query.device))
            keys, values = keys.index_select(2, order), values.index_select(2, order)  # the whole sequence, in order
            # each of this rank's two chunks attends to the keys up to its own end only (causal): a mask of
            # (2 cp_size + 1) chunk^2 entries per rank instead of 4 cp_size chunk^2, and as much less work
            chunk = length // (2 * self.degree)
            outputs = []
            for part, start in enumerate((self.layout.rank * chunk, (2 * self.degree - 1 - self.layout.rank) * chunk)):
                end = start + chunk if causal else length
                q_index = torch.arange(start, start + chunk, device=query.device)
                k_index = torch.arange(end, device=query.device)
                mask = context.allowed(q_index, k_index, causal)
                outputs.append(kernel(query[:, :, part * chunk:(part + 1) * chunk], keys[:, :, :end],
                                      values[:, :, :end], mask, False))
            return torch.cat(outputs, dim=2)

    def sequence_to_heads(self, tensor: torch.Tensor) -> torch.Tensor:
        """[batch, heads, slice, dim] -> [batch, heads / n, sequence, dim] (all-to-all over the group)."""
        batch, heads, part, dim = tensor.shape
        if heads % self.degree:
            raise ValueError(f"sequence parallelism: {heads} attention heads on this rank do not divide by sp_size="
                             f"{self.degree}; allowed: an sp_size that divides the heads, or cp_size")
        send = tensor.reshape(batch, self.degree, heads // self.degree, part, dim).transpose(0, 1).contiguous()
        received = _all_to_all(send, self.group)  # [n (source rank = sequence slice), batch, heads / n, slice, dim]
        return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // self.degree, self.degree * part, dim)

    def heads_to_sequence(self, tensor: torch.Tensor) -> torch.Tensor:
        """[batch, heads / n, sequence, dim] -> [batch, heads, slice, dim] (the inverse all-to-all)."""
        batch, heads, length, dim = tensor.shape
        part = length // self.degree
        send = tensor.reshape(batch, heads, self.degree, part, dim).permute(2, 0, 1, 3, 4).contiguous()
        received = _all_to_all(send, self.group)  # [n (source rank = head group), batch, heads / n, slice, dim]
        return received.transpose(0, 1).reshape(batch, heads * self.degree, part, dim)

    def gather_sequence(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of K or V, rank 0's first (`layout.gathered_indices` order); backward reduce-scatters."""
        return gather_slices(tensor, self.group, dim=2)

    def _ring_attention(self, query, key, value):
        """torch's ring attention (SDPA on DTensors sharded on the sequence, its head-tail load balancing, which is
        this layout), for `cp_comm_strategy: ring` on CUDA."""
        from torch.distributed.tensor import DTensor, Shard

        shards = [DTensor.from_local(t.contiguous(), self.mesh, [Shard(2)], run_check=False)
                  for t in (query, key, value)]
        out = _ORIGINAL_SDPA(*shards, is_causal=True)
        return out.to_local()

    # -- loss -------------------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def reduce_token_loss(self, loss_sum: torch.Tensor, num_tokens) -> torch.Tensor:
        """The whole sequence's mean loss from this slice's summed token losses and counted tokens (counts summed over
        the group), on every rank, with the gradient `reduce_loss` gives: one process's, on the whole sequence."""
        count = torch.as_tensor(num_tokens, device=loss_sum.device).detach().clone().to(loss_sum.dtype)
        total = self.all_reduce(count.reshape(()))
        return self.reduce_loss(loss_sum / total.clamp(min=1), summed=True)

    def reduce_loss(self, loss: torch.Tensor, count: torch.Tensor | None = None, summed: bool = False):
        """The loss of the whole sequence from this slice's, on every rank of the group.

        `summed`: the slice's loss is already its sum over the whole sequence's token count (transformers'
        num_items_in_batch). Else it is the mean over the slice's `count` tokens (None: every slice has as many).
        The value returned is the whole sequence's mean; its gradient is n times this slice's share, since the
        data-parallel reduction over dp x sp divides by n again."""
        if not summed:
            if count is None:
                loss = loss / self.degree
            else:
                total = self.all_reduce(count.detach().clone().to(loss.dtype))
                loss = torch.nan_to_num(loss) * (count.to(loss.dtype) / total.clamp(min=1))
        whole = self.all_reduce(loss.detach().clone())
        scaled = loss * self.degree
        return scaled + (whole - scaled).detach()


def _sequence_parallel_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False):
    """`torch.nn.functional.scaled_dot_product_attention` while a module of the user's runs sequence parallel: on the
    whole sequence (`SequenceParallel.attention`) inside its forward and its recomputation, torch's elsewhere."""
    sequence = _PLAIN() if _PLAIN is not None else None
    if sequence is None or _KERNEL_DEPTH[0] or not sequence.active():
        return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None:
        raise ValueError(
            "sequence parallelism: scaled_dot_product_attention got an attn_mask made for this rank's slice; "
            "allowed: is_causal=True or no mask, with padding as attention_mask and packed documents as "
            "position_ids in the batch (accel builds the mask over the whole sequence)")

    def kernel(q, k, v, mask, causal):
        return _ORIGINAL_SDPA(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale,
                              enable_gqa=enable_gqa)

    return sequence.attention(query, key, value, is_causal, kernel, sdpa=True)


@contextlib.contextmanager
def _in_kernel():
    _KERNEL_DEPTH[0] += 1
    try:
        yield
    finally:
        _KERNEL_DEPTH[0] -= 1


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    from torch.distributed.nn.functional import all_to_all_single

    return all_to_all_single(torch.empty_like(send), send, group=group)


def _eager_attention(module):
    """The eager attention function of a transformers attention module's own modeling file."""
    function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if function is None:
        raise ValueError(f"sequence parallelism: {type(module).__name__} has no eager_attention_forward in its "
                         "modeling file; allowed: attn_implementation='sdpa'")
    return function


def _shifts_labels(model) -> bool:
    """Whether a transformers model shifts its labels itself (causal LMs: their loss predicts token t+1)."""
    return type(model).__name__.endswith("ForCausalLM") or getattr(model, "loss_type", None) == "ForCausalLM" or \
        type(model).__name__.endswith("LMHeadModel")


def _loss_of(outputs):
    if isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
        return outputs
    if isinstance(outputs, Mapping):
        loss = outputs.get("loss")
        return loss if isinstance(loss, torch.Tensor) else None
    loss = getattr(outputs, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def _with_loss(outputs, loss):
    if isinstance(outputs, torch.Tensor):
        return loss
    if isinstance(outputs, Mapping) and not hasattr(outputs, "loss"):
        return {**outputs, "loss": loss}
    outputs["loss"] = loss  # transformers' ModelOutput keeps its attribute and its key in step
    return outputs
