"""Accelerate's `accelerate.commands.env` over `accel env`: `env_command` prints accel's report (versions,
devices, backends, the resolved config) and returns Accelerate's dict of the same facts."""

from __future__ import annotations

import argparse
import platform
from shutil import which

from accel.cli import env as accel_env
from accel.commands.utils import CommandParser, command_parser, without_accelerate_defaults


def env_command_parser(subparsers=None) -> CommandParser:
    parser = command_parser(accel_env.register, subparsers=subparsers)
    if subparsers is not None:
        parser.set_defaults(func=env_command)
    return parser


def _accelerator_kind() -> str:
    import torch

    if torch.cuda.is_available():
        return "CUDA"
    mps = getattr(torch.backends, "mps", None)
    return "MPS" if mps is not None and mps.is_available() else "N/A"


def _ram() -> str:
    try:
        import psutil
    except ImportError:
        return "unknown (psutil is not installed)"
    return f"{psutil.virtual_memory().total / 1024**3:.2f} GB"


def env_command(args: argparse.Namespace) -> dict:
    """Print `accel env`'s report; return {"`Accelerate` version": accel's, ..., "`Accelerate` configs": the
    resolved config}, Accelerate's keys."""
    import numpy
    import torch

    import accel
    from accel.cli import checks
    from accel.cli import launch as accel_launch
    from accel.shim import accelerate_version as shim_version

    parser = env_command_parser()
    accel_args = without_accelerate_defaults(args, parser)
    for action in parser._actions:  # a namespace made by hand may lack accel's flags
        if action.dest != argparse.SUPPRESS and not hasattr(accel_args, action.dest):
            setattr(accel_args, action.dest, action.default)
    accel_env.run_command(accel_args)
    cfg = checks.resolve_checked(accel_args.config_file, accel_launch.flag_overrides(accel_args), "accel env",
                                 accel_env.FLAGS_SOURCE)
    info = {
        "`Accelerate` version": f"{shim_version()} (accel {accel.__version__}'s shim)",
        "Platform": platform.platform(),
        "`accelerate` bash location": which("accelerate") or "Not found",
        "`accel` bash location": which("accel") or "Not found",
        "Python version": platform.python_version(),
        "Numpy version": numpy.__version__,
        "PyTorch version": torch.__version__,
        "PyTorch accelerator": _accelerator_kind(),
        "System RAM": _ram(),
    }
    if torch.cuda.is_available():
        info["GPU type"] = torch.cuda.get_device_name()
    info["`Accelerate` configs"] = cfg.to_dict()
    return info


def main() -> int:
    from accel.commands.utils import run_main

    return run_main("accelerate env", lambda: env_command(env_command_parser().parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
