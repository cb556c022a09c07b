"""`accelerate launch`'s flags (Accelerate 1.15) on `accel launch`, so a command line moves over by changing only the
program name: `accel launch --use_fsdp --fsdp_sharding_strategy FULL_SHARD train.py`.

The flags that describe training (`--use_deepspeed`/`--use_fsdp` and the DeepSpeed, `--fsdp_*` and
`--parallelism_config_*` flags) are turned into Accelerate's config-file sections (`deepspeed_config:`, `fsdp_config:`,
`parallelism_config:`) and translated by the functions that read those sections in files
(accel/config/accelerate_import.py), so a flag means what the same key means in a file; an error names the flag.
They join the launch flags' layer: over the config file, under accel's own flags (`--zero_stage`, `--tp_size`, ...),
which must not contradict them. `--use_deepspeed`/`--use_fsdp` select a route as a file's `distributed_type:
DEEPSPEED|FSDP` does: without a stage from any flag they ask for Accelerate's default (ZeRO 2; FSDP's FULL_SHARD,
stage 3), unless the config file already asks for a stage on that route (or a DeepSpeed JSON names it), which stays,
as Accelerate then takes the file's stage.

The others act on the launch: `--num_cpu_threads_per_process` (the workers' OMP_NUM_THREADS, over the environment's,
as in Accelerate), `--debug` (ACCELERATE_DEBUG_MODE), `--enable_cpu_affinity` (torchrun's NUMA binding on GPUs),
`--tee`/`--monitor_interval`/`--rdzv_conf`/`--role` (torchrun's), `--no_python`, and the DeepSpeed multi-node flags
(onto `--hostfile`/`--include`/`--exclude`). Those that cannot work here are refused in one line (exit 2), and the
ones Accelerate itself ignores off TPUs are accepted. All are hidden from `accel launch --help`; the list, with what
each does, is in docs/accelerate_compat.md.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Callable

from accel.cli._common import UsageError
from accel.config import ConfigError
from accel.config.errors import shown
from accel.config.schema import C_INT_MAX, INT64_MAX, MAX_SECONDS

FLAGS_SOURCE = "accel launch flags"  # launch.py's name for the flags' layer (errors are rewritten to the flag)


class _BadValue(Exception):
    """A flag's value is not allowed; the argument says what is."""


# -------------------------------------------------------------------------------------------------------------
# value parsers: text -> value, or _BadValue(what is allowed)
# -------------------------------------------------------------------------------------------------------------

_TRUE = ("true", "yes", "y", "t", "on", "1")
_FALSE = ("false", "no", "n", "f", "off", "0")


def _text(value: str) -> str:
    return value


def _boolean(value: str) -> bool:
    """Accelerate's str_to_bool spellings."""
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise _BadValue("true or false")


def _integer(lo: int, hi: int = C_INT_MAX) -> Callable[[str], int]:
    """An integer from `lo` to `hi` (by default a C int's largest, what torch and the OpenMP runtime take)."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise _BadValue(f"an integer >= {lo}") from None
        if number < lo:
            raise _BadValue(f"an integer >= {lo}")
        if number > hi:
            raise _BadValue(f"an integer from {lo} to {hi}")
        return number

    return parse


def _number(lo: float, above: bool = False, hi: float | None = None, unit: str = "") -> Callable[[str], float]:
    """A finite number >= `lo` (> with `above`), at most `hi` when given; `unit` names what it counts."""
    noun = f"a number of {unit}" if unit else "a number"
    allowed = f"{noun} {'>' if above else '>='} {lo:g}" + (f", at most {hi:.15g}" if hi is not None else "")

    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise _BadValue(allowed) from None
        if not math.isfinite(number) or number < lo or (above and number == lo) or (hi is not None and number > hi):
            raise _BadValue(allowed)
        return number

    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        for choice in choices:
            if value.lower() == choice.lower():
                return choice
        raise _BadValue("one of " + ", ".join(choices))

    return parse


def _bool_or_text(value: str) -> bool | str:
    """`--fsdp_reshard_after_forward`: true/false (FSDP2) or a sharding strategy name (FSDP1)."""
    try:
        return _boolean(value)
    except _BadValue:
        return value


# -------------------------------------------------------------------------------------------------------------
# the flags
# -------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Flag:
    """One of Accelerate's flags: a switch (no value) or a value with its parser, and where it goes: an Accelerate
    config section ("deepspeed_config", "fsdp_config", "parallelism_config"), "launch" (read by this module) or
    "accepted" (no effect in accel; the docs say why)."""

    parse: Callable[[str], Any] | None  # None: a switch
    goes_to: str


_SWITCH = None
# Accelerate's FSDP enumerations (accelerate.utils.constants)
_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
_STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")

ACCEPTED: dict[str, Flag] = {
    # route selectors
    "use_deepspeed": Flag(_SWITCH, "launch"),
    "use_fsdp": Flag(_SWITCH, "launch"),
    "use_parallelism_config": Flag(_SWITCH, "accepted"),  # the --parallelism_config_* flags given always count
    # DeepSpeed (`deepspeed_config:`); --zero_stage, --gradient_accumulation_steps, --deepspeed_config_file are accel's
    "offload_optimizer_device": Flag(_text, "deepspeed_config"),
    "offload_param_device": Flag(_text, "deepspeed_config"),
    "offload_optimizer_nvme_path": Flag(_text, "deepspeed_config"),
    "offload_param_nvme_path": Flag(_text, "deepspeed_config"),
    "gradient_clipping": Flag(_number(0), "deepspeed_config"),
    "zero3_init_flag": Flag(_boolean, "accepted"),  # ZeRO-3 shards at prepare(); a meta-device model is materialized
    "zero3_save_16bit_model": Flag(_boolean, "accepted"),  # save_model always gathers the full weights
    # FSDP (`fsdp_config:`)
    "fsdp_sharding_strategy": Flag(_text, "fsdp_config"),
    "fsdp_reshard_after_forward": Flag(_bool_or_text, "fsdp_config"),
    "fsdp_offload_params": Flag(_boolean, "fsdp_config"),
    "fsdp_activation_checkpointing": Flag(_boolean, "fsdp_config"),
    "fsdp_auto_wrap_policy": Flag(_text, "fsdp_config"),
    "fsdp_transformer_layer_cls_to_wrap": Flag(_text, "fsdp_config"),
    "fsdp_min_num_params": Flag(_integer(0, INT64_MAX), "fsdp_config"),
    "fsdp_activation_checkpointing_offload": Flag(_boolean, "fsdp_config"),  # true: refused below
    "fsdp_version": Flag(_choice("1", "2"), "accepted"),  # accel's ZeRO 2/3 is FSDP2 either way
    "fsdp_backward_prefetch": Flag(_choice(*_PREFETCH), "accepted"),
    "fsdp_forward_prefetch": Flag(_boolean, "accepted"),
    "fsdp_state_dict_type": Flag(_choice(*_STATE_DICT_TYPES), "accepted"),
    "fsdp_use_orig_params": Flag(_boolean, "accepted"),
    "fsdp_cpu_ram_efficient_loading": Flag(_boolean, "accepted"),
    "fsdp_sync_module_states": Flag(_boolean, "accepted"),
    # ParallelismConfig (`parallelism_config:`)
    **{f"parallelism_config_{size}": Flag(_integer(1), "parallelism_config")
       for size in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")},
    "parallelism_config_cp_backend": Flag(_text, "parallelism_config"),
    "parallelism_config_sp_backend": Flag(_text, "parallelism_config"),
    "parallelism_config_cp_comm_strategy": Flag(_text, "parallelism_config"),
    "parallelism_config_sp_seq_length": Flag(_text, "parallelism_config"),
    "parallelism_config_sp_seq_length_is_variable": Flag(_boolean, "parallelism_config"),
    "parallelism_config_sp_attn_implementation": Flag(_text, "parallelism_config"),
    # the launch itself
    "num_cpu_threads_per_process": Flag(_integer(1), "launch"),
    "enable_cpu_affinity": Flag(_SWITCH, "launch"),
    "debug": Flag(_SWITCH, "launch"),
    "no_python": Flag(_SWITCH, "launch"),
    "tee": Flag(_text, "launch"),
    "monitor_interval": Flag(_number(0, above=True, hi=MAX_SECONDS, unit="seconds"), "launch"),
    "rdzv_conf": Flag(_text, "launch"),
    "role": Flag(_text, "launch"),
    "same_network": Flag(_SWITCH, "launch"),
    "deepspeed_hostfile": Flag(_text, "launch"),
    "deepspeed_inclusion_filter": Flag(_text, "launch"),
    "deepspeed_exclusion_filter": Flag(_text, "launch"),
    "deepspeed_multinode_launcher": Flag(_text, "launch"),
    "fp8_backend": Flag(_text, "launch"),
    "quiet": Flag(_SWITCH, "accepted"),  # accel's launcher prints one line per failed rank, never its own traceback
    "downcast_bf16": Flag(_SWITCH, "accepted"),  # TPU only; Accelerate ignores it elsewhere (so do config files)
    "main_training_function": Flag(_text, "accepted"),  # TPU only; likewise
}

_MEGATRON = "Megatron-LM is not available yet in accel; tensor and pipeline parallelism are --tp_size / --pp_size"
_TPU = "TPUs (torch_xla) are not available in accel, which runs on CPUs and CUDA GPUs"
_TE = ("tunes Transformer Engine's fp8, which is not available yet in accel (accel's fp8 is torchao's: "
       "--mixed_precision fp8); leave it out")
_AO = ("is not available yet in accel as a launch flag; pass Accelerator(kwargs_handlers=[AORecipeKwargs(config="
       "torchao.float8.Float8LinearConfig(...))]) instead")
# flag -> (takes a value, why it is refused)
REFUSED: dict[str, tuple[bool, str]] = {
    "use_megatron_lm": (False, _MEGATRON),
    **{f"megatron_lm_{name}": (True, _MEGATRON) for name in (
        "tp_degree", "pp_degree", "num_micro_batches", "sequence_parallelism", "recompute_activations",
        "use_distributed_optimizer", "gradient_clipping", "use_custom_fsdp", "no_load_optim", "no_save_optim",
        "eod_mask_loss", "overlap_cpu_optimizer_d2h_h2d", "optimizer_cpu_offload", "use_precision_aware_optimizer",
        "decoder_last_pipeline_num_layers", "recompute_granularity", "recompute_method", "recompute_num_layers",
        "attention_backend", "expert_model_parallel_size", "context_parallel_size", "attention_dropout",
        "hidden_dropout", "attention_softmax_in_fp32", "expert_tensor_parallel_size", "calculate_per_token_loss",
        "use_rotary_position_embeddings")},
    "tpu": (False, _TPU),
    "tpu_cluster": (False, _TPU),
    "no_tpu_cluster": (False, _TPU),
    "tpu_use_sudo": (False, _TPU),
    "vm": (True, _TPU),
    "env": (True, "sets variables on TPU pod VMs (TPU only), which accel does not run on; set them in the "
                  "environment instead (with --hostfile: in .accel_env)"),
    "aws_access_key_id": (True, "Amazon SageMaker launches are not available in accel; run accel launch on the "
                                "instances"),
    "aws_secret_access_key": (True, "Amazon SageMaker launches are not available in accel; run accel launch on the "
                                    "instances"),
    "mpirun_hostfile": (True, "MPI (mpirun) launches are not available yet in accel; use --hostfile (ssh) or "
                              "`srun accel launch` under SLURM"),
    "deepspeed_moe_layer_cls_names": (True, "DeepSpeed's mixture-of-experts layers are not available yet in accel"),
    "fp8_use_autocast_during_eval": (False, _TE),
    **{f"fp8_{name}": (True, _TE) for name in (
        "margin", "interval", "format", "amax_history_len", "amax_compute_algo", "override_linear_precision")},
    "fp8_opt_level": (True, "tunes MS-AMP, which is not available in accel (accel's fp8 is torchao's); leave it out"),
    "fp8_enable_fsdp_float8_all_gather": (True, _AO),
    "fp8_pad_inner_dim": (True, _AO),
}

# DeepSpeed's multi-node launchers: pdsh (its default) starts one launcher per host over ssh, as --hostfile does;
# "standard" is one accel launch per machine, started by the user (the hostfile is not used, as in Accelerate)
_SSH_LAUNCHERS = ("pdsh",)
_OWN_LAUNCHERS = ("standard",)
_OTHER_LAUNCHERS = {
    "slurm": "run `srun --ntasks-per-node=1 accel launch ...` in the job instead",
    "nossh": "run accel launch on every machine with --machine_rank (Accelerate's 'standard') instead",
    "openmpi": "use --hostfile (ssh) instead", "mvapich": "use --hostfile (ssh) instead",
    "mpich": "use --hostfile (ssh) instead",
}
_SHORT = {"quiet": "-q", "tee": "-t"}  # Accelerate's short spellings
_APPENDED = ("vm", "env")  # Accelerate's repeatable flags
# the flags `accel env` takes too (they only shape the config)
CONFIG_FLAGS = tuple(name for name, flag in ACCEPTED.items()
                     if flag.goes_to in ("deepspeed_config", "fsdp_config", "parallelism_config")
                     or name in ("use_deepspeed", "use_fsdp", "use_parallelism_config", "same_network"))


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Accelerate's flags, hidden from `--help` (docs/accelerate_compat.md lists them)."""
    group = parser.add_argument_group("accelerate launch's flags")
    parser.epilog = parser.epilog or ("accelerate launch's flags (--use_fsdp, --fsdp_*, --use_deepspeed, "
                                      "--offload_optimizer_device, --parallelism_config_*, ...) are taken too: see "
                                      "docs/accelerate_compat.md")
    hidden = argparse.SUPPRESS
    for name, flag in ACCEPTED.items():
        short = (_SHORT[name],) if name in _SHORT else ()
        if flag.parse is None:
            _add(group, name, short, action="store_true", default=None, help=hidden)
        else:
            _add(group, name, short, metavar="VALUE", default=None, help=hidden)
    for name, (takes_value, _) in REFUSED.items():
        if not takes_value:
            _add(group, name, (), action="store_true", default=None, help=hidden)
        else:
            _add(group, name, (), metavar="VALUE", default=None, help=hidden,
                 action="append" if name in _APPENDED else "store")


def _add(group, name: str, short: tuple[str, ...], **kwargs) -> None:
    """`--name`, its `--dash-spelling` (Accelerate takes both) and Accelerate's short spelling if any."""
    names = [f"--{name}", *([f"--{name.replace('_', '-')}"] if "_" in name else []), *short]
    group.add_argument(*names, dest=name, **kwargs)


def given(args: argparse.Namespace, name: str) -> Any:
    """The flag's raw value (None: not given); works on `accel env`'s namespace, which has only some of them."""
    return getattr(args, name, None)


def value_of(args: argparse.Namespace, name: str) -> Any:
    """The flag's parsed value (None: not given); a bad one is a one-line UsageError naming the flag."""
    raw = given(args, name)
    flag = ACCEPTED[name]
    if raw is None or flag.parse is None:
        return raw
    try:
        return flag.parse(raw)
    except _BadValue as exc:
        raise UsageError(f"--{name}: bad value {shown(raw)}; allowed: {exc}") from None


# -------------------------------------------------------------------------------------------------------------
# before anything else: refused flags, contradictions, the multi-node flags
# -------------------------------------------------------------------------------------------------------------

def prepare(args: argparse.Namespace) -> None:
    """Refuse the flags that cannot work here, check the launch flags' values and contradictions, and map the
    DeepSpeed multi-node flags onto accel's own (`args` is changed: the remote launchers never see them)."""
    for name, (_, why) in REFUSED.items():
        if given(args, name) not in (None, False):
            raise UsageError(f"--{name}: {why}")
    for name, flag in ACCEPTED.items():
        if flag.goes_to in ("launch", "accepted"):
            value_of(args, name)  # a bad value fails now, even for a flag without effect
    if given(args, "module") and given(args, "no_python"):
        raise UsageError("--module and --no_python contradict each other (as in Accelerate); give one of them")
    _fp8_backend(args)
    _torchrun_values(args)
    _map_multinode(args)


def _fp8_backend(args: argparse.Namespace) -> None:
    """`--fp8_backend ao` is accel's fp8 (torchao); te and msamp are refused as a file's `fp8_config.backend` is."""
    backend = given(args, "fp8_backend")
    if backend is None:
        return
    from accel.config.accelerate_import import check_fp8_section

    if backend.lower() not in ("ao", "te", "msamp"):
        raise UsageError(f"--fp8_backend: bad value {backend!r}; allowed: ao (te and msamp are not available)")
    _translated(lambda: check_fp8_section({"backend": backend}, FLAGS_SOURCE))


def _map_multinode(args: argparse.Namespace) -> None:
    launcher = (given(args, "deepspeed_multinode_launcher") or _SSH_LAUNCHERS[0]).lower()
    if launcher in _OTHER_LAUNCHERS:
        raise UsageError(f"--deepspeed_multinode_launcher {launcher}: not available yet in accel; "
                         f"{_OTHER_LAUNCHERS[launcher]}")
    if launcher not in _SSH_LAUNCHERS + _OWN_LAUNCHERS:
        raise UsageError(f"--deepspeed_multinode_launcher: bad value {launcher!r}; allowed: "
                         f"{', '.join(_SSH_LAUNCHERS + _OWN_LAUNCHERS + tuple(_OTHER_LAUNCHERS))}")
    for theirs, ours in (("deepspeed_hostfile", "hostfile"), ("deepspeed_inclusion_filter", "include"),
                         ("deepspeed_exclusion_filter", "exclude")):
        value = given(args, theirs)
        if value is None:
            continue
        if given(args, ours) is not None and given(args, ours) != value:
            raise UsageError(f"--{theirs} and --{ours} both given, with different values; give one of them")
        if launcher in _SSH_LAUNCHERS:
            setattr(args, ours, value)
        setattr(args, theirs, None)
    args.deepspeed_multinode_launcher = None


_TEE = re.compile(r"[0-3]|\d+:[0-3](,\d+:[0-3])*")
_RDZV_PAIR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=[^,=]*[^,=\s][^,=]*")  # torchrun refuses an empty value


# the rendezvous options torchrun reads as numbers (seconds, attempts) or from a list, only once the agent runs: a bad
# one would fail after the launch began (exit 1), so they are refused with the other flags
_RDZV_INTEGERS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "keep_alive_interval",
                  "keep_alive_max_attempt", "read_timeout", "timeout")
_RDZV_CHOICES = {"store_type": ("tcp", "file")}


def _rdzv_typed(pairs: list[str]) -> None:
    for pair in pairs:
        key, value = (part.strip() for part in pair.split("=", 1))
        if key in _RDZV_INTEGERS:
            try:
                number = int(value)
            except ValueError:
                number = 0
            if not 1 <= number <= C_INT_MAX:
                raise UsageError(f"--rdzv_conf: {key}={shown(value)}: bad value; allowed: an integer from 1 to "
                                 f"{C_INT_MAX}")
        if key in _RDZV_CHOICES and value.lower() not in _RDZV_CHOICES[key]:
            raise UsageError(f"--rdzv_conf: {key}={shown(value)}: bad value; allowed: "
                             f"{', '.join(_RDZV_CHOICES[key])}")


def _torchrun_values(args: argparse.Namespace) -> None:
    tee = given(args, "tee")
    if tee is not None and not _TEE.fullmatch(tee):
        raise UsageError(f"--tee: bad value {tee!r}; allowed: 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per "
                         "local rank like 0:3,1:1")
    conf = given(args, "rdzv_conf")
    if conf:
        pairs = conf.split(",")
        if not all(_RDZV_PAIR.fullmatch(pair) for pair in pairs):
            raise UsageError(f"--rdzv_conf: bad value {conf!r}; allowed: key=value pairs separated by commas, e.g. "
                             "join_timeout=900,read_timeout=120")
        if any(pair.split("=")[0] == "is_host" for pair in pairs):
            raise UsageError("--rdzv_conf: is_host is set by accel launch (the machine with machine_rank 0 hosts the "
                             "rendezvous); allowed: the other rendezvous options")
        _rdzv_typed(pairs)
    if given(args, "role") == "":
        raise UsageError("--role: empty; allowed: a name for the workers' role, e.g. trainer")


# -------------------------------------------------------------------------------------------------------------
# the config: Accelerate's sections, translated as files' are
# -------------------------------------------------------------------------------------------------------------

# accel's parallelism keys that accel's own flags (named as the key) and these flags may both set
_SHARED_KEYS = {
    "zero_stage": ("fsdp_reshard_after_forward", "fsdp_sharding_strategy"),
    "tp_size": ("parallelism_config_tp_size",),
    "sp_size": ("parallelism_config_sp_size",),
    "cp_size": ("parallelism_config_cp_size",),
    "cp_comm_strategy": ("parallelism_config_cp_comm_strategy",),
    "activation_checkpointing": ("fsdp_activation_checkpointing",),
}
_NO_NVME = ("", "none")


def add_config_overrides(raw: dict, args: argparse.Namespace) -> dict:
    """`raw` (the layer of accel's launch flags) with what the given Accelerate flags mean added; accel's own flags
    may not contradict them. Empty additions when none is given."""
    mine = config_overrides(args)
    if not mine:
        return raw
    out = {**raw, **{k: v for k, v in mine.items() if k != "parallelism"}}
    ours = dict(raw.get("parallelism", {}))
    for key, value in mine.get("parallelism", {}).items():
        if key in ours and ours[key] != value:
            theirs = next(name for name in _SHARED_KEYS.get(key, ()) if given(args, name) is not None)
            raise UsageError(f"--{key} {ours[key]} and --{theirs} {given(args, theirs)} disagree "
                             f"({key} {ours[key]} vs {value}); allowed: give one of them")
    if mine.get("parallelism"):
        out["parallelism"] = {**mine["parallelism"], **ours}
    return out


def config_overrides(args: argparse.Namespace) -> dict:
    """The config layer (accel's keys) that the given Accelerate flags mean, translated by the functions that read
    Accelerate's config files; a ConfigError names the flag."""
    if given(args, "use_deepspeed") and given(args, "use_fsdp"):
        raise UsageError("--use_deepspeed and --use_fsdp contradict each other; give one of them")
    sections: dict[str, dict] = {"deepspeed_config": {}, "fsdp_config": {}, "parallelism_config": {}}
    for name, flag in ACCEPTED.items():
        if flag.goes_to in sections and given(args, name) is not None:
            sections[flag.goes_to][name] = value_of(args, name)
    _refuse_section_values(sections)
    par = _translated(lambda: _translate(sections))
    stage = _selector_stage(args, par)
    if stage is not None:
        par["zero_stage"] = stage
    layer: dict = {"parallelism": par} if par else {}
    if given(args, "same_network"):
        layer["same_network"] = True
    return layer


def _refuse_section_values(sections: dict[str, dict]) -> None:
    ds, fsdp = sections["deepspeed_config"], sections["fsdp_config"]
    for name, device_flag in (("offload_optimizer_nvme_path", "offload_optimizer_device"),
                              ("offload_param_nvme_path", "offload_param_device")):
        path = ds.pop(name, None)
        if path is not None and path.lower() not in _NO_NVME:
            raise UsageError(f"--{name}: nvme offload is not supported by accel; allowed: --{device_flag} cpu "
                             "(leave the nvme path out)")
    if fsdp.pop("fsdp_activation_checkpointing_offload", False):
        raise UsageError("--fsdp_activation_checkpointing_offload: offloading checkpointed activations to the CPU is "
                         "not available yet in accel; allowed: false (--fsdp_activation_checkpointing true recomputes "
                         "them instead)")


def _translate(sections: dict[str, dict]) -> dict:
    from accel.config.accelerate_import import (
        from_deepspeed_section,
        from_fsdp_section,
        from_parallelism_config_section,
    )

    par: dict = {}
    ds, fsdp, layout = sections["deepspeed_config"], sections["fsdp_config"], sections["parallelism_config"]
    if ds:
        par.update(from_deepspeed_section(ds, FLAGS_SOURCE)[0])
    if fsdp:
        fsdp_par = from_fsdp_section(fsdp, FLAGS_SOURCE)
        if "fsdp_sharding_strategy" not in fsdp and "fsdp_reshard_after_forward" not in fsdp:
            fsdp_par.pop("zero_stage")  # the section's default stage belongs to the selector (--use_fsdp)
        par.update(fsdp_par)
    if layout:
        par.update(from_parallelism_config_section(layout, FLAGS_SOURCE))
    return par


_SECTION_KEY = re.compile(re.escape(FLAGS_SOURCE) + r": key '(?:deepspeed_config|fsdp_config|parallelism_config|"
                          r"fp8_config)\.(\w+)'")


def _translated(translate: Callable[[], Any]) -> Any:
    """Run a section translation; its errors name the flag (`--fsdp_sharding_strategy: bad value ...`) instead of
    the file key (`key 'fsdp_config.fsdp_sharding_strategy'`)."""
    try:
        return translate()
    except ConfigError as exc:
        def flag(match: re.Match) -> str:
            key = match.group(1)
            return "--fp8_backend" if key == "backend" else f"--{key}"

        raise ConfigError(_SECTION_KEY.sub(flag, str(exc))) from None


def _selector_stage(args: argparse.Namespace, par: dict) -> int | None:
    """The ZeRO stage `--use_deepspeed` (2) / `--use_fsdp` (3) ask for when nothing else names one: no flag does
    (accel's --zero_stage, a sharding strategy, a dp_shard_size layout), no DeepSpeed JSON is given, and the config
    file asks for no stage on that route (a file of the other route: its stage is that route's, not this one's)."""
    route = "DEEPSPEED" if given(args, "use_deepspeed") else "FSDP" if given(args, "use_fsdp") else None
    if route is None or "zero_stage" in par or given(args, "zero_stage") is not None:
        return None
    if (par.get("dp_shard_size") or 1) > 1:
        return None  # the layout decides (ZeRO 3 unless a stage is given), as in files
    if route == "DEEPSPEED" and given(args, "deepspeed_config_file"):
        return None  # the JSON's stage, as a file's `deepspeed_config_file` gives it
    if _file_stage(given(args, "config_file"), route) > 0:
        return None
    return 2 if route == "DEEPSPEED" else 3


def _file_stage(config_file: str | None, route: str) -> int:
    """The ZeRO stage the config files ask for on `route` (0: none)."""
    from accel.config import file_layers, merge_layers, user_config_path
    from accel.config.parallelism import requested_zero_stage
    from accel.config.yaml_file import load_yaml_file

    path = user_config_path(config_file)
    if path is not None and os.path.isfile(path):  # (os.path's: False for a path the OS refuses, as too long)
        data = load_yaml_file(path)
        file_route = str(data.get("distributed_type") or "").upper() if isinstance(data, dict) else ""
        if file_route in ("DEEPSPEED", "FSDP") and file_route != route:
            return 0
    return requested_zero_stage(merge_layers(file_layers(config_file)).get("parallelism", {}))


# -------------------------------------------------------------------------------------------------------------
# the launch: workers' environment, torchrun's flags, the command
# -------------------------------------------------------------------------------------------------------------

def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """Variables for the workers: `--num_cpu_threads_per_process` (OMP_NUM_THREADS, over the environment's, as in
    Accelerate; accel's own per-core default then stays out) and `--debug` (Accelerate's debug mode)."""
    env = {}
    threads = value_of(args, "num_cpu_threads_per_process")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if given(args, "debug"):
        env["ACCELERATE_DEBUG_MODE"] = "true"
    return env


def uses_gpus(cfg) -> bool:
    """Whether the launch's processes run on CUDA GPUs (torch is imported only when they may)."""
    if cfg.use_cpu or cfg.distributed_type == "MULTI_CPU":
        return False
    if cfg.distributed_type == "MULTI_GPU":
        return True
    import torch

    return torch.cuda.is_available()


def needs_agent(args: argparse.Namespace, cfg) -> bool:
    """One process runs under torchrun's agent too when it is what binds it (`--enable_cpu_affinity` on a GPU)."""
    return bool(given(args, "enable_cpu_affinity")) and uses_gpus(cfg)


def torchrun_flags(args: argparse.Namespace, cfg) -> list[str]:
    """torchrun's flags for `--monitor_interval`, `--role`, `--tee` (with --log_dir: which streams its files get;
    accel tees both otherwise), `--no_python` and `--enable_cpu_affinity` (torchrun's NUMA binding of each process
    to its GPU's node, as Accelerate's affinity does; CPU launches are not bound, as in Accelerate)."""
    argv: list[str] = []
    interval = value_of(args, "monitor_interval")
    if interval is not None:
        argv += ["--monitor_interval", f"{interval:g}"]
    if given(args, "role") is not None:
        argv += ["--role", given(args, "role")]
    if given(args, "tee") is not None and given(args, "log_dir"):
        argv += ["--tee", given(args, "tee")]
    if given(args, "no_python"):
        argv.append("--no-python")
    if given(args, "enable_cpu_affinity") and uses_gpus(cfg):
        if shutil.which("numactl") is None:
            raise UsageError("--enable_cpu_affinity: torch's NUMA binding (torchrun --numa-binding) needs the numactl "
                             "command, which is not installed; install it (e.g. apt install numactl) or leave the "
                             "flag out")
        argv += ["--numa-binding", "node"]
    return argv


def rdzv_conf(args: argparse.Namespace) -> str:
    """`--rdzv_conf`'s pairs (checked by `prepare`), for torchrun's --rdzv_conf."""
    return given(args, "rdzv_conf") or ""


def command(args: argparse.Namespace, python: str, script_argv: list[str]) -> list[str]:
    """The one-process command: `python script ...`, or with `--no_python` the program itself."""
    return list(script_argv) if given(args, "no_python") else [python, *script_argv]


def check_program(program: str) -> None:
    """`--no_python`'s program: an executable file, or a command on PATH (as exec finds it)."""
    if os.sep in program:
        if not os.path.isfile(program):
            raise UsageError(f"--no_python: program not found: {program}; allowed: an executable file or a command "
                             "on PATH")
        if not os.access(program, os.X_OK):
            raise UsageError(f"--no_python: {program} is not executable; allowed: an executable file (chmod +x "
                             f"{program}), or leave --no_python out for a Python script")
    elif shutil.which(program) is None:
        hint = f" (for the file here: ./{program})" if os.path.isfile(program) else ""
        raise UsageError(f"--no_python: command not found on PATH: {program}{hint}; allowed: an executable file or a "
                         "command on PATH")
