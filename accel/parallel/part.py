"""The protocol of one parallel dimension (a "part"): what a dimension does at each moment of a run, as the step
owners (accel/backends/) call it, in the order of their list of parts, without knowing which dimension it is.

Every method does nothing by default, so a dimension implements only the moments it takes part in:

- prepare: decide on the whole model before a pipeline cuts it (`plan_whole_model`); change the model before the
  recipe runs (`prepare`); its step of the recipe, after float8 conversion and before activation checkpointing and
  data parallelism (`transform`); under FSDP2, shard its own modules over its own mesh first (`shard_first`); after
  the recipe, on the unwrapped model (`install`); several prepared models made one (`adopt`: a pipeline's stages);
- data and loss: cut a batch (`cut_batch`), the loss function given to prepare (`note_loss_fn`), reduce a loss
  (`reduce_loss`, `reduce_token_loss`), shift labels over what the ranks hold together (`shift_labels`);
- the step: around a backward, reduce the gradients it owns (`around_backward`); its share of the gradient norm
  (`norm_claims`, `norm_share`);
- checkpoints: whether a rank holds only part of the state (`splits_state`, `held_names`), its local tensors as
  DTensors and back (`checkpoint_state`, `load_model_state`, `load_optimizer_state`,
  `load_consolidated_optimizer_state`), gathering a full state dict (`full_state`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch


class Part:
    """One parallel dimension; every hook's default leaves things as they are."""

    name = "part"
    title = "a parallel dimension"  # how messages name it
    replaces_parameters = False  # prepare gives the model new (DTensor) parameters: the optimizer must not have stepped
    save_pretrained_note: str | None = None  # what save_pretrained of a prepared model would miss (None: nothing)
    cuts_batches = False  # cut_batch changes batches (the prepared DataLoaders apply it)
    replica_dim: str | None = None  # the ranks holding the same copy of this dimension's parameters, when fewer than
    # the gradient ranks: ZeRO-1 shards its optimizer state over them

    # -- prepare ----------------------------------------------------------------------------------------------
    def plan_whole_model(self, model: torch.nn.Module) -> None:
        """Decide what depends on the whole model before a pipeline cuts it into stages."""

    def prepare(self, model: torch.nn.Module, recipe: Any) -> None:
        """Before the recipe runs on `model`: change it, or note in `recipe` what other steps leave alone."""

    def transform(self, model: torch.nn.Module, recipe: Any) -> None:
        """This dimension's step of the recipe (after float8 conversion, before checkpointing and data parallelism)."""

    def shard_first(self, model: torch.nn.Module, options: dict) -> None:
        """Under FSDP2, before the repeated blocks: shard modules over a mesh of this dimension's own, given
        `fully_shard`'s options without the mesh."""

    def install(self, model: torch.nn.Module) -> None:
        """After the recipe, on the unwrapped prepared model."""

    def adopt(self, whole: torch.nn.Module, models: list[torch.nn.Module]) -> None:
        """`models`, each prepared, now run as `whole` (a pipeline's stages on this process)."""

    # -- data and loss ----------------------------------------------------------------------------------------
    def cut_batch(self, batch):
        """This rank's part of a batch."""
        return batch

    def note_loss_fn(self, loss_fn) -> None:
        """The loss function given to prepare: `model(x, target=y)` computes the loss with it (and `reduce_loss`
        reduces it), outside the model's forward."""

    def reduce_loss(self, loss: torch.Tensor, target) -> torch.Tensor:
        """The loss `loss_fn` computed on this rank's part of the data, as the step needs it."""
        return loss

    def reduce_token_loss(self, loss_sum: torch.Tensor, num_tokens) -> torch.Tensor | None:
        """The mean token loss from this rank's summed token losses (None: not this dimension's to say)."""
        return None

    def shift_labels(self, labels: torch.Tensor) -> torch.Tensor | None:
        """A causal LM's labels shifted one token left (None: not this dimension's to say)."""
        return None

    # -- the step ---------------------------------------------------------------------------------------------
    def around_backward(self, sync: bool) -> contextlib.AbstractContextManager:
        """Context around a backward (or a pipeline's step); `sync`: the gradients are reduced in it."""
        return contextlib.nullcontext()

    def norm_claims(self) -> set[int]:
        """The ids of the parameters whose gradients this dimension counts in the norm itself (`norm_share`)."""
        return set()

    def norm_share(self, parameters: list[torch.Tensor], norm_type: float) -> torch.Tensor | None:
        """The claimed gradients' share of the norm: sum |g|^p over every rank holding them (inf: max |g|); None:
        this dimension claims none (every rank of its group answers alike)."""
        return None

    # -- checkpoints ------------------------------------------------------------------------------------------
    @property
    def splits_state(self) -> bool:
        """Whether a rank holds only part of the model or optimizer state because of this dimension."""
        return False

    def held_names(self) -> set[str] | None:
        """The model's tensor names this rank holds, when it holds only some (None: all)."""
        return None

    def checkpoint_state(self, model: torch.nn.Module, state: dict) -> dict:
        """A model's or optimizer's training-checkpoint state with this rank's tensors placed in the whole."""
        return state

    def load_model_state(self, model: torch.nn.Module, state: dict) -> dict:
        """A checkpoint's model state as this rank loads it."""
        return state

    def load_optimizer_state(self, model: torch.nn.Module, state: dict) -> dict:
        """A checkpoint's optimizer state as this rank loads it."""
        return state

    def load_consolidated_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                          state: dict) -> dict:
        """An optimizer state one replica wrote (ZeRO-1's consolidated state) as this rank's optimizer loads it."""
        return state

    def full_state(self, model: torch.nn.Module, state: dict) -> dict:
        """A full state dict (CPU) with this dimension's tensors whole, in the model's names (every rank calls)."""
        return state

    # -- lifetime ---------------------------------------------------------------------------------------------
    def forget(self) -> None:
        """Drop references to prepared models."""


@contextlib.contextmanager
def around_backward(parts: Iterable[Part], sync: bool) -> Iterator[None]:
    """Every part's `around_backward`, entered in order."""
    with contextlib.ExitStack() as stack:
        for part in parts:
            stack.enter_context(part.around_backward(sync))
        yield


def norm_claims(parts: Iterable[Part]) -> set[int]:
    """The ids of the parameters the parts count in the norm themselves."""
    return set().union(*(part.norm_claims() for part in parts))


def norm_shares(parts: Iterable[Part], parameters: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each part's share of the norm (after the others' norm: the same collectives, in the same order, everywhere)."""
    return [share for share in (part.norm_share(parameters, norm_type) for part in parts) if share is not None]


def with_shares(norm: torch.Tensor, shares: list[torch.Tensor], norm_type: float, powered: bool = False):
    """`norm` (of the other gradients) combined with the parts' shares: the total norm, or with `powered` the total
    sum |g|^p (inf: the max), as a reduction over more ranks needs it."""
    if norm_type == float("inf"):
        for share in shares:
            norm = torch.maximum(norm, share.to(norm.device))
        return norm
    total = norm ** norm_type
    for share in shares:
        total = total + share.to(total.device)
    return total if powered else total ** (1.0 / norm_type)
