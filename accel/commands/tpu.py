"""Accelerate's `accelerate tpu-config`: its parser (so command lines parse), and a one-line refusal: accel runs on
CPUs and CUDA GPUs, not TPUs."""

from __future__ import annotations

import argparse

from accel.cli._common import UsageError
from accel.commands.utils import CommandParser

REFUSAL = ("TPUs (torch_xla, gcloud TPU VMs) are not available in accel, which runs on CPUs "
           "and CUDA GPUs; run the commands on the machines yourself")


def tpu_command_parser(subparsers=None) -> argparse.ArgumentParser:
    if subparsers is not None:
        parser = subparsers.add_parser("tpu-config")
    else:
        parser = CommandParser(prog="accelerate tpu-config", description=f"Not available in accel: {REFUSAL}")
    for flag in ("--config_file", "--tpu_name", "--tpu_zone", "--command_file", "--accelerate_version"):
        parser.add_argument(flag, default=None)
    parser.add_argument("--command", action="append", nargs="+", default=None)
    for flag in ("--use_alpha", "--install_accelerate", "--debug"):
        parser.add_argument(flag, action="store_true")
    if subparsers is not None:
        parser.set_defaults(func=tpu_command_launcher)
    return parser


def tpu_command_launcher(args: argparse.Namespace) -> None:
    raise UsageError(REFUSAL)


def main() -> int:
    from accel.commands.utils import run_main

    return run_main("accelerate tpu-config", lambda: tpu_command_launcher(tpu_command_parser().parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
