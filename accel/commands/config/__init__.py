"""Accelerate's `accelerate.commands.config` over `accel config` (accel/cli/config.py): `get_config_parser`, `main`, and
the config-file names of `config_args`."""

from __future__ import annotations

from accel.commands.config.config import config_command, config_command_parser
from accel.commands.config.config_args import default_config_file, load_config_from_file
from accel.commands.config.default import default_command_parser, default_config_command, write_basic_config


def get_config_parser(subparsers=None):
    """`accelerate config` (questions; `accelerate config default` without them), accel's parser."""
    return config_command_parser(subparsers)


def main() -> None:
    parser = get_config_parser()
    args = parser.parse_args()
    if not hasattr(args, "func"):
        parser.print_help()
        raise SystemExit(1)
    raise SystemExit(args.func(args))


__all__ = ["config_command", "config_command_parser", "default_command_parser", "default_config_command",
           "default_config_file", "get_config_parser", "load_config_from_file", "main", "write_basic_config"]
