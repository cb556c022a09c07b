"""Accelerate's `accelerate.commands.config.default`: `write_basic_config` (accel.compat.environment's) and the
`accelerate config default` subcommand (accel's `accel config default`)."""

from __future__ import annotations

import argparse

from accel.cli import config as accel_config
from accel.commands.config.config_args import default_json_config_file, default_yaml_config_file  # noqa: F401
from accel.compat.environment import write_basic_config

description = "Write accel's default config for this machine without questions (`accel config default`)."


def default_command_parser(parser, parents=None):
    """Accelerate adds `default` to its config parser's subcommands: accel's `config` parser has it already."""
    return parser


def default_config_command(args: argparse.Namespace) -> int:
    """`accel config default`: the packaged default (with --mixed_precision), unless a file is there (--force)."""
    for name, value in (("default_config_file", None), ("config_file", None), ("mixed_precision", None),
                        ("force", False)):
        if not hasattr(args, name):
            setattr(args, name, value)
    if getattr(args, "save_location", None) and not args.default_config_file:
        args.default_config_file = args.save_location
    return accel_config.run_default(args)


__all__ = ["default_command_parser", "default_config_command", "description", "write_basic_config"]
