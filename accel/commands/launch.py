"""Accelerate's `accelerate.commands.launch` over `accel launch` (accel/cli/launch.py).

`launch_command_parser()` is accel's launch parser (every `accelerate launch` flag, both spellings; the help lists
one) with Accelerate's defaults in the namespace (`multi_gpu` False, `fsdp_sharding_strategy` "FULL_SHARD", ...) and
the script as `training_script` / `training_script_args`. `launch_command(args)` checks the config in this process
(a bad value raises accel's one-line ConfigError / UsageError here), then runs `accel launch` with the flags the
namespace sets, in a subprocess, and raises `subprocess.CalledProcessError` when it fails, as Accelerate does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from accel.cli import accelerate_flags
from accel.cli import launch as accel_launch
from accel.commands.utils import GIVEN, CommandParser, command_parser, without_accelerate_defaults

# `accelerate launch`'s defaults (Accelerate 1.15) where accel's parser leaves None: the namespace a script gets
# looks like Accelerate's; accel's code sees None again for what was not given
ACCELERATE_DEFAULTS = {
    "cpu": False, "multi_gpu": False, "tpu": False, "tpu_use_sudo": False, "tpu_use_cluster": False,
    "use_deepspeed": False, "use_fsdp": False, "use_megatron_lm": False, "use_parallelism_config": False,
    "enable_cpu_affinity": False, "same_network": False, "downcast_bf16": False, "module": None,
    "rdzv_backend": "static", "rdzv_conf": "", "role": "default", "tee": "0", "monitor_interval": 0.1,
    "dynamo_mode": "default", "dynamo_use_fullgraph": False, "dynamo_use_dynamic": False,
    "dynamo_use_regional_compilation": False,
    "fsdp_version": "1", "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_reshard_after_forward": "true",
    "fsdp_offload_params": "false", "fsdp_min_num_params": 100000000, "fsdp_use_orig_params": "true",
    "fsdp_sync_module_states": "true", "fsdp_cpu_ram_efficient_loading": "true", "fsdp_forward_prefetch": "false",
    "fsdp_activation_checkpointing": "false", "fsdp_activation_checkpointing_offload": "false",
    "parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": 1,
    "parallelism_config_tp_size": 1, "parallelism_config_cp_size": 1, "parallelism_config_sp_size": 1,
    "parallelism_config_cp_backend": "torch", "parallelism_config_cp_comm_strategy": "allgather",
    "parallelism_config_sp_backend": "deepspeed", "parallelism_config_sp_seq_length_is_variable": True,
    "parallelism_config_sp_attn_implementation": "sdpa",
    "megatron_lm_tp_degree": 1, "megatron_lm_pp_degree": 1, "megatron_lm_gradient_clipping": 1.0,
    "megatron_lm_eod_mask_loss": False, "megatron_lm_no_load_optim": False, "megatron_lm_no_save_optim": False,
    "megatron_lm_use_custom_fsdp": False, "megatron_lm_optimizer_cpu_offload": False,
    "megatron_lm_overlap_cpu_optimizer_d2h_h2d": False, "megatron_lm_use_precision_aware_optimizer": False,
    "fp8_opt_level": "O2", "fp8_margin": 0, "fp8_interval": 1, "fp8_format": "HYBRID", "fp8_amax_history_len": 1024,
    "fp8_amax_compute_algo": "most_recent", "fp8_override_linear_precision": (False, False, False),
    "fp8_use_autocast_during_eval": False, "fp8_pad_inner_dim": 1, "fp8_enable_fsdp_float8_all_gather": 1,
}
_CONFIG_FILLED = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
                  "mixed_precision", "gpu_ids", "gradient_accumulation_steps", "dynamo_backend", "rdzv_backend")


class _LaunchParser(CommandParser):
    """Adds Accelerate's names for the script and its arguments."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        parsed.training_script = parsed.script
        parsed.training_script_args = list(parsed.script_args or [])
        for name, flag in accelerate_flags.ACCEPTED.items():  # Accelerate's numeric flags hold numbers
            raw = getattr(parsed, name, None)
            if isinstance(raw, str) and flag.parse is not None:
                try:
                    value = flag.parse(raw)
                except Exception:  # noqa: BLE001 (a bad value is refused, naming the flag, when accel reads it)
                    continue
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    setattr(parsed, name, value)
        given = getattr(parsed, GIVEN)
        given -= {"script", "script_args"}
        if parsed.script:
            given |= {"training_script", "training_script_args"}
        return parsed, extras


def launch_command_parser(subparsers=None) -> CommandParser:
    parser = command_parser(accel_launch.register, ACCELERATE_DEFAULTS, subparsers, _LaunchParser)
    parser.description = ((parser.description or "") + " Every flag is also taken with dashes (--num-processes for "
                          "--num_processes).")
    if subparsers is not None:
        parser.set_defaults(func=launch_command)
    return parser


_PARSER = None


def _parser() -> CommandParser:
    global _PARSER
    if _PARSER is None:
        _PARSER = launch_command_parser()
    return _PARSER


def _accel_args(args: argparse.Namespace) -> argparse.Namespace:
    """The namespace as accel's own launch parser makes it (the script from Accelerate's names)."""
    out = without_accelerate_defaults(args, _parser())
    for dest in ("training_script", "training_script_args", GIVEN):
        if hasattr(out, dest):
            delattr(out, dest)
    out.script = getattr(args, "training_script", None) or getattr(args, "script", None)
    out.script_args = list(getattr(args, "training_script_args", None) or getattr(args, "script_args", None) or [])
    for action in _parser()._actions:  # a namespace made by hand (Accelerate's tests do) may lack some
        if action.dest is not argparse.SUPPRESS and not hasattr(out, action.dest):
            setattr(out, action.dest, action.default)
    return out


def _resolved(accel_args: argparse.Namespace):
    """accel launch's checks and config resolution, in this process (raises ConfigError / UsageError)."""
    from accel.cli import accelerate_flags, checks

    checks.check_flag_conflicts(accel_args)
    accelerate_flags.prepare(accel_args)
    return checks.resolve_checked(accel_args.config_file, accel_launch.flag_overrides(accel_args), "accel launch",
                                  accel_launch.FLAGS_SOURCE)


def _validate_launch_command(args: argparse.Namespace):
    """Accelerate's validation step: the config (file, flags) resolved by accel, its values written into `args`
    where the command line left them unset. Returns (args, defaults, mp_from_config_flag): `defaults` is the config
    file read as Accelerate's ClusterConfig (None without a file), `mp_from_config_flag` whether mixed_precision
    came from that file."""
    from accel.commands.config.config_args import load_config_from_file
    from accel.config import user_config_path

    given: set[str] = getattr(args, GIVEN, set())
    cfg = _resolved(_accel_args(args))
    for dest in _CONFIG_FILLED:
        value = getattr(cfg, dest, None)
        if dest not in given and value is not None:
            setattr(args, dest, value)
    if args.num_processes is None:
        args.num_processes = cfg.num_processes
    args.cpu = bool(args.cpu or cfg.use_cpu)
    args.multi_gpu = bool(args.multi_gpu or cfg.distributed_type == "MULTI_GPU")
    args.debug = bool(getattr(args, "debug", False) or getattr(cfg, "debug", False))
    path = user_config_path(getattr(args, "config_file", None))
    defaults = load_config_from_file(str(path)) if path is not None and path.is_file() else None
    mp_from_config_flag = "mixed_precision" not in given and defaults is not None
    return args, defaults, mp_from_config_flag


def to_argv(args: argparse.Namespace) -> list[str]:
    """`accel launch`'s command line for `args` (only the flags whose values differ from accel's defaults)."""
    accel_args = _accel_args(args)
    argv: list[str] = []
    for action in _parser()._actions:
        if not action.option_strings or action.dest in ("help", "script", "script_args"):
            continue
        value = getattr(accel_args, action.dest, action.default)
        if value == action.default or value is None:
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:
            argv.append(flag)
        elif isinstance(value, list) and isinstance(action, argparse._AppendAction):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    if not accel_args.script:
        return argv
    return [*argv, accel_args.script, *map(str, accel_args.script_args)]


def _shim_on() -> bool:
    from accel.shim import active

    return active()


def _script_of_real_test_utils(script: str | None) -> str | None:
    """A script Accelerate's tests name inside the `accelerate` package (`path_in_accelerate_package("test_utils",
    "scripts", ...)`, built from `accelerate.__file__`): under the shim that folder is the shim's, which holds no
    `test_utils`; the shim loads `accelerate.test_utils` from the real Accelerate installation, so the script is read
    there too. Any other path is kept as it is."""
    from accel.core.shim_version import FACADE
    from accel.shim import REAL_ONLY, real_accelerate_dir

    if not script or os.path.exists(script):
        return script
    package = os.path.dirname(FACADE)
    relative = os.path.relpath(os.path.abspath(script), package)
    real = real_accelerate_dir()
    if real is None or relative.split(os.sep)[0] != REAL_ONLY[0].split(".")[1]:
        return script
    found = os.path.join(real, relative)
    return found if os.path.isfile(found) else script


def launch_command(args: argparse.Namespace) -> None:
    """Run `accel launch` for `args` and wait; `subprocess.CalledProcessError` when it fails."""
    if getattr(args, "training_script", None):
        args.training_script = _script_of_real_test_utils(args.training_script)
    _resolved(_accel_args(args))  # a bad flag or config fails here, in one line, before any process starts
    argv = to_argv(args)
    if _shim_on() and "--accelerate_shim" not in argv:
        argv.insert(0, "--accelerate_shim")
    cmd = [sys.executable, "-m", "accel.cli.main", "launch", *argv]
    sys.stdout.flush()
    result = subprocess.run(cmd, env=dict(os.environ))
    if result.returncode != 0:
        raise subprocess.CalledProcessError(returncode=result.returncode, cmd=cmd)


def main() -> int:
    from accel.commands.utils import run_main

    def run():
        try:
            launch_command(launch_command_parser().parse_args())
        except subprocess.CalledProcessError as exc:  # accel launch has said why
            raise SystemExit(exc.returncode) from None

    return run_main("accelerate launch", run)


if __name__ == "__main__":
    sys.exit(main())
