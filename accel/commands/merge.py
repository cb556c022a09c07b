"""Accelerate's `accelerate.commands.merge` over `accel merge-weights` (accel.cli.merge, accel.checkpoint.merge)."""

from __future__ import annotations

import argparse

from accel.cli import merge as accel_merge
from accel.commands.utils import command_parser

description = accel_merge.__doc__.split("\n\n")[0]


def merge_command_parser(subparsers=None) -> argparse.ArgumentParser:
    parser = command_parser(accel_merge.register, subparsers=subparsers)
    if subparsers is not None:
        parser.set_defaults(func=merge_command)
    return parser


def merge_command(args: argparse.Namespace) -> None:
    """`merge_fsdp_weights(args.checkpoint_directory, args.output_path, ...)`; a bad folder raises its one-line
    ValueError (MergeError) here, where the `accel merge-weights` command exits 2 with it."""
    from accel.checkpoint.merge import merge_fsdp_weights

    merge_fsdp_weights(args.checkpoint_directory, args.output_path, not args.unsafe_serialization,
                       args.remove_checkpoint_dir)


def main() -> int:
    from accel.checkpoint.merge import MergeError
    from accel.commands.utils import run_main

    return run_main("accel merge-weights", lambda: merge_command(merge_command_parser().parse_args()), (MergeError,))


if __name__ == "__main__":
    raise SystemExit(main())
