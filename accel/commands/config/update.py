"""Accelerate's `accelerate config update`: rewrite a config file with every key in its current spelling. Here:
read with accel's reader (which refuses unknown keys and bad values in one line) and written back with
Accelerate's field names, atomically."""

from __future__ import annotations

import argparse

from accel.commands.config.config_args import default_config_file, load_config_from_file
from accel.commands.utils import CommandParser

description = "Update an existing config file with the latest defaults while keeping the old configuration."


def update_config(args: argparse.Namespace) -> str:
    path = args.config_file or default_config_file
    config = load_config_from_file(path)
    if path.endswith(".json"):
        config.to_json_file(path)
    else:
        config.to_yaml_file(path)
    return path


def update_command_parser(parser=None, parents=None) -> argparse.ArgumentParser:
    if parser is None:
        parser = CommandParser(prog="accelerate config update", description=description)
    else:
        parser = parser.add_parser("update", parents=parents or [], help=description, description=description)
    parser.add_argument("--config_file", default=None, help="the config file to update (default: accel's)")
    parser.set_defaults(func=update_config_command)
    return parser


def update_config_command(args: argparse.Namespace) -> None:
    print(f"Successfully updated the configuration file at {update_config(args)}.")
