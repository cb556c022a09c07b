"""`accel`: the command line entry point (`accel config`, `accel launch`, `accel env`, `accel plot`,
`accel estimate-memory`, `accel plan`, `accel merge-weights`, `accel shim`).

Every user mistake (bad flag, bad config value, missing script, port in use, ...) is reported as ONE line,
`accel <cmd>: error: <message>`, on stderr with exit code 2 and no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from accel.core.version import __version__
from accel.cli import config as config_cmd
from accel.cli import env as env_cmd
from accel.cli import estimate as estimate_cmd
from accel.cli import launch as launch_cmd
from accel.cli import merge as merge_cmd
from accel.cli import plan as plan_cmd
from accel.cli import plot as plot_cmd
from accel.cli import shim as shim_cmd
from accel.cli._common import OneLineParser, UsageError, unrecognized
from accel.cli.fault_tolerance import GROUP_ENV
from accel.config import ConfigError


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="accel",
        description="Configure and launch PyTorch training scripts on one CPU, many processes, GPUs or machines.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"accel {__version__}",
                        help="print accel's version and exit")
    subparsers = parser.add_subparsers(dest="command", parser_class=OneLineParser,
                                       metavar="{config,launch,env,plot,estimate-memory,plan,merge-weights,shim}")
    config_cmd.register(subparsers)
    launch_cmd.register(subparsers)
    env_cmd.register(subparsers)
    plot_cmd.register(subparsers)
    estimate_cmd.register(subparsers)
    plan_cmd.register(subparsers)
    merge_cmd.register(subparsers)
    shim_cmd.register(subparsers)
    return parser


def _subparsers(parser) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if extras:  # report them as the subcommand's error (`accel launch: error: ...`), not the top level's
        sub = _subparsers(parser).get(args.command, parser) if args.command else parser
        sub.error(unrecognized(sub, extras))
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    prog = f"accel {args.command}"
    try:
        code = args.func(args)
    except (ConfigError, UsageError) as exc:
        message = " ".join(str(exc).split())  # always exactly one line
        sys.stdout.flush()
        sys.stderr.write(f"{prog}: error: {message}\n")
        return 2
    except BrokenPipeError:  # output piped into `head` and the like: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        if os.environ.get(GROUP_ENV) is None:  # a replica group's launcher: its head says how the job ended
            sys.stderr.write(f"{prog}: interrupted\n")
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
