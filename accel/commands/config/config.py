"""Accelerate's `accelerate.commands.config.config`: `config_command_parser` / `config_command` are accel's
`accel config` questionnaire (one answer per line on stdin), saving accel's config file."""

from __future__ import annotations

import argparse

from accel.cli import config as accel_config
from accel.commands.utils import command_parser


def config_command_parser(subparsers=None) -> argparse.ArgumentParser:
    parser = command_parser(accel_config.register, subparsers=subparsers)
    if subparsers is not None:
        parser.set_defaults(func=config_command)
    return parser


def config_command(args: argparse.Namespace) -> int:
    """Ask accel's questions and save the answers (`args.config_file`, else accel's default path)."""
    if getattr(args, "config_command", None) == "default":
        return accel_config.run_default(args)
    return accel_config.run_questionnaire(args)


def main() -> int:
    from accel.commands.utils import run_main

    return run_main("accelerate config", lambda: config_command(config_command_parser().parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
