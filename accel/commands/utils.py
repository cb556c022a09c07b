"""Shared pieces of `accel.commands`: a parser whose help shows each flag once, and its namespaces' bookkeeping."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from accel.cli._common import OneLineParser

GIVEN = "nondefault"  # namespace attribute (Accelerate's name): the destinations the command line itself set


class OneSpellingHelpFormatter(argparse.HelpFormatter):
    """Lists `--num_processes` only, not also its `--num-processes` alias (both are accepted, as in Accelerate)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        original = action.option_strings
        action.option_strings = [s for s in original if not _dash_alias(s, original)] or original
        try:
            return super()._format_action_invocation(action)
        finally:
            action.option_strings = original


def _dash_alias(option: str, options: Sequence[str]) -> bool:
    return option.startswith("--") and "-" in option[2:] and "--" + option[2:].replace("-", "_") in options


class CommandParser(OneLineParser):
    """accel's one-line-error parser with Accelerate's defaults put into the namespace for what was not given;
    which destinations the command line set is kept (GIVEN) so that accel's code sees only those."""

    def __init__(self, *args, accelerate_defaults: dict | None = None, **kwargs):
        kwargs.setdefault("formatter_class", OneSpellingHelpFormatter)
        super().__init__(*args, **kwargs)
        self.accelerate_defaults = dict(accelerate_defaults or {})

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        own = {a.dest: a.default for a in self._actions if a.dest is not argparse.SUPPRESS}
        given = {dest for dest, default in own.items() if getattr(parsed, dest, default) != default}
        setattr(parsed, GIVEN, given)
        for dest, value in self.accelerate_defaults.items():
            if dest not in given:
                setattr(parsed, dest, value)
        return parsed, extras


def command_parser(register, accelerate_defaults: dict | None = None, subparsers=None,
                   parser_class: type = CommandParser) -> CommandParser:
    """The parser accel's `register(subparsers)` builds for its subcommand, as a CommandParser named `accelerate
    <name>`; with Accelerate's `subparsers` given, added to those (Accelerate's `X_command_parser(subparsers)`)."""
    if subparsers is None:
        holder = argparse.ArgumentParser(prog="accelerate", add_help=False)
        subparsers = holder.add_subparsers(parser_class=parser_class)
    previous, subparsers._parser_class = subparsers._parser_class, parser_class
    try:
        parser = register(subparsers)
    finally:
        subparsers._parser_class = previous
    parser.accelerate_defaults = dict(accelerate_defaults or {})
    return parser


def without_accelerate_defaults(args: argparse.Namespace, parser: CommandParser) -> argparse.Namespace:
    """A copy of `args` as accel's own parser would have made it: Accelerate's defaults that the command line did
    not set (and that the caller did not change since) back to accel's `None`/`False`."""
    out = argparse.Namespace(**vars(args))
    given: set[str] = getattr(args, GIVEN, set())
    own = {a.dest: a.default for a in parser._actions if a.dest is not argparse.SUPPRESS}
    for dest, value in parser.accelerate_defaults.items():
        if dest in own and dest not in given and getattr(args, dest, None) == value:
            setattr(out, dest, own[dest])
    return out


def run_main(prog: str, run, errors: tuple = ()) -> int:
    """A module's `main()` (`python -m accel.commands.X`): a user error is one line `PROG: error: ...` on stderr
    and exit code 2, as `accel`'s CLI does; `errors` adds exception types that are user errors for this command."""
    import sys

    from accel.cli._common import UsageError
    from accel.config import ConfigError

    try:
        run()
    except (ConfigError, UsageError, *errors) as exc:
        sys.stdout.flush()
        sys.stderr.write(f"{prog}: error: {' '.join(str(exc).split())}\n")
        return 2
    return 0
