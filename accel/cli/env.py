"""`accel env`: print the facts a bug report needs (versions, devices, backends, the config in use)."""

from __future__ import annotations

import argparse
import os
import platform
import sys

from accel.cli import checks, kubeflow
from accel.cli import launch as launch_cmd
from accel.cli._common import UsageError, add_flag
from accel.config import USER_CONFIG_ENV, ConfigError, user_config_path

FLAGS_SOURCE = "accel env flags"


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "env",
        help="print versions, devices and the resolved config (for bug reports)",
        description="Print accel, torch, Python and OS versions, the devices and distributed backends, "
        "the config file in use and the resolved config. `accel launch`'s config flags (--num_processes, "
        "--tp_size, ...) are taken too: the config is then the one that launch would run with, checked alike.",
        allow_abbrev=False,
    )
    add_flag(parser, "config_file", metavar="PATH", default=None,
             help=f"config file to resolve (default: ${USER_CONFIG_ENV}, else ~/.cache/accel/default_config.yaml)")
    add_launch_config_flags(parser)
    parser.set_defaults(func=run_command)
    return parser


def add_launch_config_flags(parser: argparse.ArgumentParser) -> None:
    """`accel launch`'s flags that feed the config (its own definitions, so help and types match)."""
    wanted = {*launch_cmd.CONFIG_FLAGS, "cpu", "multi_gpu"}
    group = parser.add_argument_group("accel launch flags (resolve the config a launch would run with)")
    donor = launch_cmd.register(argparse.ArgumentParser(add_help=False).add_subparsers())
    for action in donor._actions:
        if action.dest in wanted and action.option_strings:
            group._add_action(action)


def _shim_version() -> str:
    from accel.core.shim_version import ShimVersionError, accelerate_version

    try:
        return accelerate_version()
    except ShimVersionError as err:
        return f"unusable: {err}"


def environment_lines() -> list[str]:
    import torch
    import torch.distributed as dist

    from accel.core.version import __version__
    from accel.core.shim_version import VERSION_ENV

    lines = [
        f"- accel version: {__version__}",
        f"- Accelerate version the shim answers as: {_shim_version()} (`accelerate.__version__` and the `accelerate` "
        f"distribution's metadata under --accelerate_shim; pin another with ${VERSION_ENV})",
        f"- PyTorch version: {torch.__version__} (built with CUDA: {torch.version.cuda or 'no'})",
        f"- Python version: {platform.python_version()} ({sys.executable})",
        f"- OS: {platform.platform()}",
        f"- CPU cores: {os.cpu_count()}",
    ]
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    lines.append(f"- CUDA available: {'yes' if cuda else 'no'}; devices: {count}")
    for index in range(count):
        lines.append(f"  - cuda:{index}: {torch.cuda.get_device_name(index)}")
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        lines.append(f"- CUDA_VISIBLE_DEVICES: {os.environ['CUDA_VISIBLE_DEVICES']!r}")
    available = dist.is_available()
    gloo = available and dist.is_gloo_available()
    nccl = available and dist.is_nccl_available()
    lines.append(f"- torch.distributed: {'yes' if available else 'no'}; gloo: {'yes' if gloo else 'no'}; "
                 f"nccl: {'yes' if nccl else 'no'}")
    return lines


def run_command(args: argparse.Namespace) -> int:
    print("Copy and paste the text below into your bug report.\n")
    for line in environment_lines():
        print(line)
    path = user_config_path(args.config_file)
    print(f"- accel config file: {path if path is not None else 'none: embedded default'}")
    sys.stdout.flush()
    try:  # the same resolution and rules as `accel launch`
        checks.check_flag_conflicts(args)
        overrides, pod = launch_cmd.flags_and_pod(args)
        cfg = checks.resolve_checked(args.config_file, overrides, "accel env", FLAGS_SOURCE)
    except (ConfigError, UsageError):
        print("- resolved config: (not available, see the error below)")
        raise
    cluster = kubeflow.describe(pod)  # in a Kubernetes pod: which values its variables gave, and which lost
    if cluster is not None:
        print(cluster)
    print(f"- run: {checks.layout(cfg)}")
    print("- resolved config:")  # after each value: where it came from
    for line in checks.annotated_yaml(cfg, launch_cmd.value_sources(args, FLAGS_SOURCE)):
        print(f"    {line}")
    return 0
