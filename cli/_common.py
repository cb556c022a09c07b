"""Pieces shared by the `accel` subcommands: the user-error type and a one-line-error argument parser."""

from __future__ import annotations

import argparse
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


def add_flag(parser: argparse._ActionsContainer, name: str, **kwargs) -> argparse.Action:
    """Add `--name_with_underscores` and its `--dash-spelling` alias (Accelerate accepts both)."""
    names = [f"--{name}"]
    if "_" in name:
        names.append("--" + name.replace("_", "-"))
    kwargs.setdefault("dest", name)
    return parser.add_argument(*names, **kwargs)
