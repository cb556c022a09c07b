"""Accelerate's handler objects for `ParallelismConfig(tp_handler=, cp_handler=, sp_handler=)`. accel's TP, CP and
SP take their sizes and strategy from ParallelismConfig's fields; of these objects it reads `cp_comm_strategy`
(schema.py) and `sp_allow_recurrent_layers` (accel/parallel/sequence.py). The environment variables that fill their
unset fields are Accelerate's (`PARALLELISM_CONFIG_*`, which `accelerate launch` and `accel launch` set)."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass


def _env_flag(name: str, default: str) -> bool:
    return os.environ.get(name, default).lower() == "true"


@dataclass
class TorchContextParallelConfig:
    """`cp_comm_strategy`: "allgather" (the default) or "alltoall" (accel: also "ring")."""

    cp_comm_strategy: str | None = None

    def __post_init__(self) -> None:
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = os.environ.get("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "allgather")
        if self.cp_comm_strategy not in ("allgather", "alltoall", "ring"):
            raise ValueError(f"Invalid cp_comm_strategy: {self.cp_comm_strategy}. Must be one of 'allgather' or "
                             "'alltoall' (or accel's 'ring').")


@dataclass
class TorchTensorParallelConfig:
    """`enable_async_tp`: not supported (as in Accelerate, a warning and ignored)."""

    enable_async_tp: bool = False

    def __post_init__(self) -> None:
        if self.enable_async_tp:
            warnings.warn("Async tensor parallelism is currently not supported, ignoring this option.", stacklevel=2)


@dataclass
class DeepSpeedSequenceParallelConfig:
    """Accelerate 1.16's fields. accel's own Ulysses (sp_size) needs no DeepSpeed: it takes any sequence length that
    sp_size divides and the model's own attention, so `sp_seq_length*` and `sp_attn_implementation` are kept, not
    read. `sp_allow_recurrent_layers=False` (the default) refuses models with linear-attention layers, whose state
    would restart on every rank. `sp_disable_in_eval`: accel keeps sequence parallelism on in eval (the eval loader
    is cut like the train one, Accelerate's False), giving the same numbers (docs/accelerate_compat.md)."""

    sp_seq_length: int | None = None
    sp_seq_length_is_variable: bool | None = None
    sp_attn_implementation: str | None = None
    sp_allow_recurrent_layers: bool | None = None
    sp_disable_in_eval: bool | None = None

    def __post_init__(self) -> None:
        if self.sp_seq_length_is_variable is None:
            self.sp_seq_length_is_variable = _env_flag("PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE", "true")
        if not self.sp_seq_length_is_variable and self.sp_seq_length is None:
            given = os.environ.get("PARALLELISM_CONFIG_SP_SEQ_LENGTH")
            if given is None:
                raise ValueError("when `sp_seq_length_is_variable` is `False` `sp_seq_length` must be provided either "
                                 "through the constructor or the environment variable PARALLELISM_CONFIG_SP_SEQ_LENGTH")
            self.sp_seq_length = None if given == "None" else int(given)
        if self.sp_attn_implementation is None:
            self.sp_attn_implementation = os.environ.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION")
        if self.sp_allow_recurrent_layers is None:
            self.sp_allow_recurrent_layers = _env_flag("PARALLELISM_CONFIG_SP_ALLOW_RECURRENT_LAYERS", "false")
        if self.sp_disable_in_eval is None:
            self.sp_disable_in_eval = _env_flag("PARALLELISM_CONFIG_SP_DISABLE_IN_EVAL", "true")
