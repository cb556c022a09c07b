"""Accelerate's `accelerate` command (`accelerate_cli.main`) over `accel`: `config`, `launch`, `env`,
`estimate-memory` and `merge-weights` are accel's own subcommands; `test`, `tpu-config`, `to-fsdp2` and
`config update` are Accelerate's, from this package."""

from __future__ import annotations

import importlib
import sys

# Accelerate's subcommands that accel's CLI does not have: (module, parser, command)
_OWN = {
    "test": ("accel.commands.test", "test_command_parser", "test_command"),
    "tpu-config": ("accel.commands.tpu", "tpu_command_parser", "tpu_command_launcher"),
    "to-fsdp2": ("accel.commands.to_fsdp2", "to_fsdp2_command_parser", "to_fsdp2_command"),
    "config update": ("accel.commands.config.update", "update_command_parser", "update_config_command"),
}


def main(argv: list[str] | None = None) -> int:
    from accel.cli._common import UsageError
    from accel.cli.main import main as accel_main

    argv = sys.argv[1:] if argv is None else list(argv)
    name = " ".join(argv[:2]) if argv[:2] == ["config", "update"] else (argv[0] if argv else "")
    if name not in _OWN:
        return accel_main(argv)
    module_name, parser_name, command_name = _OWN[name]
    module = importlib.import_module(module_name)
    args = getattr(module, parser_name)().parse_args(argv[len(name.split()):])
    try:
        getattr(module, command_name)(args)
    except UsageError as exc:
        sys.stderr.write(f"accelerate {name}: error: {exc}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
