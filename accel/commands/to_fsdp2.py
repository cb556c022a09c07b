"""Accelerate's `accelerate to-fsdp2`: rewrite an Accelerate config file's `fsdp_config:` from FSDP1 to FSDP2 keys.

In accel both versions run as FSDP2 (ZeRO 2/3 with `fully_shard`) and its reader takes either spelling; this keeps
Accelerate's command for files shared with Accelerate. FSDP1-only keys are dropped (each named once in a warning),
`fsdp_sharding_strategy` becomes `fsdp_reshard_after_forward` (true where the strategy shards parameters, i.e.
ZeRO 3 in accel's reading of the file), the rest is kept, and `fsdp_version: 2` is set. Written atomically.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from accel.commands.utils import CommandParser

logger = logging.getLogger(__name__)
DROPPED = {  # FSDP1 key -> why it has no FSDP2 spelling
    "fsdp_backward_prefetch": "removed in FSDP2",
    "fsdp_use_orig_params": "removed in FSDP2",
    "fsdp_sync_module_states": "removed in FSDP2",
    "fsdp_forward_prefetch": "not yet implemented in FSDP2",
}
RENAMED = {"fsdp_sharding_strategy": "fsdp_reshard_after_forward"}


def _reshards(strategy) -> bool | object:
    """FSDP1 strategy -> FSDP2's reshard_after_forward (accel's reading: a strategy of ZeRO stage 3 reshards)."""
    from accel.config.accelerate_import import _FSDP_STRATEGY_TO_STAGE

    if isinstance(strategy, bool):
        return strategy
    stage = _FSDP_STRATEGY_TO_STAGE.get(str(strategy).upper())
    return strategy if stage is None else stage == 3


def convert_config_to_fsdp2(config: dict) -> dict:
    """`config` with its `fsdp_config` in FSDP2 keys (unchanged without one, or when it is FSDP2 already)."""
    fsdp = config.get("fsdp_config") or {}
    if not fsdp:
        logger.info("No FSDP config found in the config file, skipping conversion...")
        return config
    if str(fsdp.get("fsdp_version", 1)) == "2":
        logger.warning("Config already specifies FSDP2, skipping conversion...")
        return config
    converted = {}
    for key, value in fsdp.items():
        if key in DROPPED:
            logger.warning(f"Argument {key} is {DROPPED[key]}, skipping this key...")
        elif key in RENAMED or key == "fsdp_reshard_after_forward":
            converted[RENAMED.get(key, key)] = _reshards(value)
        else:
            converted[key] = value
    converted["fsdp_version"] = 2
    config["fsdp_config"] = converted
    return config


def to_fsdp2_command_parser(subparsers=None) -> argparse.ArgumentParser:
    description = "Convert an Accelerate config from FSDP1 to FSDP2"
    if subparsers is not None:
        parser = subparsers.add_parser("to-fsdp2", description=description)
    else:
        parser = CommandParser(prog="accelerate to-fsdp2", description=description)
    parser.add_argument("--config_file", required=True, help="the config file to convert")
    parser.add_argument("--overwrite", action="store_true", default=False, help="write the result over the input")
    parser.add_argument("--output_file", default=None, help="where to write the result (else --overwrite)")
    if subparsers is not None:
        parser.set_defaults(func=to_fsdp2_command)
    return parser


def load_config(config_file: str) -> dict:
    from accel.config.yaml_file import load_yaml_file

    config = load_yaml_file(Path(config_file))
    if not isinstance(config, dict) or not config:
        raise ValueError(f"config file {config_file} is empty; allowed: a YAML mapping of config keys")
    return config


def to_fsdp2_command(args: argparse.Namespace) -> None:
    import yaml

    from accel.checkpoint.layout import atomic_write

    if not Path(args.config_file).exists():
        raise FileNotFoundError(f"Config file {args.config_file} not found")
    if not args.overwrite and args.output_file is None:
        raise ValueError("If --overwrite is not set, --output_file must be provided")
    if not args.overwrite and Path(args.output_file).exists():
        raise FileExistsError(f"Output file {args.output_file} already exists and --overwrite is not set")
    config = convert_config_to_fsdp2(load_config(args.config_file))
    target = Path(args.output_file or args.config_file)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target.parent, target.name, lambda tmp: Path(tmp).write_text(yaml.safe_dump(config)))
