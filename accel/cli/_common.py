"""Pieces shared by the `accel` subcommands: the user-error type and a one-line-error argument parser."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import NoReturn

DEFAULT_MULTI_MACHINE_PORT = 29500  # the rendezvous port of a launch over several machines (Accelerate's)

class UsageError(Exception):
    """A mistake on the command line or in the environment; `accel` prints it as one line and exits 2."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (`accel <cmd>: error: ...`) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
        sys.exit(2)

    def parse_args(self, args=None, namespace=None):
        """argparse's, with the flag a misspelt one most likely meant (`unrecognized`)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unrecognized(self, extras))
        return parsed


def unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's `unrecognized arguments: ...`, with the flag each misspelt one most likely meant (`--num_process`:
    did you mean --num_processes?). Where a parser takes no abbreviations (allow_abbrev=False: launch, config, env,
    as Accelerate's), a near miss is refused with the hint, never taken for the flag it resembles."""
    flags = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    hints = []
    for extra in extras:
        name = extra.split("=", 1)[0]
        if name.startswith("--") and name not in flags:
            close = difflib.get_close_matches(name, flags, n=1, cutoff=0.75)
            if close:
                hints.append((name, close[0]))
    message = f"unrecognized arguments: {' '.join(extras)}"
    if len(hints) == 1:
        return f"{message}; did you mean {hints[0][1]}?"
    if hints:
        return f"{message}; did you mean {', '.join(f'{close} (for {name})' for name, close in hints)}?"
    return message


def add_flag(parser: argparse._ActionsContainer, name: str, **kwargs) -> argparse.Action:
    """Add `--name_with_underscores` and its `--dash-spelling` alias (Accelerate accepts both)."""
    names = [f"--{name}"]
    if "_" in name:
        names.append("--" + name.replace("_", "-"))
    kwargs.setdefault("dest", name)
    return parser.add_argument(*names, **kwargs)
