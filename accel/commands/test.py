"""Accelerate's `accelerate test`: run Accelerate's own test_script.py with `accel launch --accelerate_shim` (the
config from --config_file or accel's default), to check that this machine can run distributed training. Where no real
Accelerate is installed (so no test_script.py), accel's own check runs instead (accel/commands/launch_check.py)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from accel.cli._common import UsageError
from accel.commands.utils import CommandParser


def test_command_parser(subparsers=None) -> argparse.ArgumentParser:
    if subparsers is not None:
        parser = subparsers.add_parser("test")
    else:
        parser = CommandParser(prog="accelerate test", description="Check that accel can launch training here.")
    parser.add_argument("--config_file", default=None,
                        help="the config to launch with (default: $ACCEL_CONFIG_FILE, else accel's default file)")
    if subparsers is not None:
        parser.set_defaults(func=test_command)
    return parser


def test_script_path() -> Path:
    """Accelerate's test_script.py from a real Accelerate installation (it is Accelerate's test, not accel's)."""
    from accel.shim import real_accelerate_dir

    root = real_accelerate_dir()
    script = Path(root, "test_utils", "scripts", "test_script.py") if root else None
    if script is None or not script.is_file():
        raise UsageError("accelerate test runs Accelerate's own test_utils/scripts/test_script.py, which needs the "
                         "accelerate package installed (pip install accelerate); or run your script with accel launch")
    return script


def check_script_path() -> Path:
    """accel's own check, run where Accelerate (and so its test_script.py) is not installed."""
    return Path(__file__).with_name("launch_check.py")


def test_command(args: argparse.Namespace) -> None:
    """`accel launch [--config_file F] --accelerate_shim test_script.py` (`accel launch [--config_file F]
    launch_check.py` where Accelerate is not installed); CalledProcessError when it fails."""
    from accel.core.shim_version import real_accelerate_installed

    config = ["--config_file", args.config_file] if args.config_file else []
    shim = ["--accelerate_shim", str(test_script_path())] if real_accelerate_installed() else [str(check_script_path())]
    cmd = [sys.executable, "-m", "accel.cli.main", "launch", *config, *shim]
    result = subprocess.run(cmd)
    if result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, cmd)
    print("Test is a success! You are ready for your distributed training!")


def main() -> int:
    from accel.commands.utils import run_main

    return run_main("accelerate test", lambda: test_command(test_command_parser().parse_args()),
                    (subprocess.CalledProcessError,))


if __name__ == "__main__":
    raise SystemExit(main())
