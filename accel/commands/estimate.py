"""Accelerate's `accelerate.commands.estimate` over accel's estimator (accel/planning/estimate.py,
`accel estimate-memory`).

The model is built on the meta device from a local transformers config (config.json or its folder), a model type
(`gpt2`), `module:callable`, or a Hub name whose config transformers can read (its cache, or the Hub when online).
`gather_data` returns Accelerate's rows `[dtype, largest layer bytes, total bytes, training bytes]`: the sizes from
accel's `calculate_maximum_sizes` (Accelerate's no-split-aware largest layer), the training bytes (a dict whose
largest value is the total) from accel's AdamW estimate on one process, which mixed precision does not change in
accel (float32 master weights); int8/int4 have no training estimate (-1, shown as N/A).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from accel.commands.utils import CommandParser

DTYPES = ("float32", "float16", "int8", "int4")
_DIVISOR = {"float32": 1, "float16": 2, "bfloat16": 2, "int8": 4, "int4": 8}
description = "Estimate the memory a model needs to load and to train, built on the meta device (no weights)."


def estimate_command_parser(subparsers=None) -> argparse.ArgumentParser:
    if subparsers is not None:
        parser = subparsers.add_parser("estimate-memory", description=description)
    else:
        parser = CommandParser(prog="accelerate estimate-memory", description=description)
    parser.add_argument("model_name", help="a transformers config.json or its folder, a model type (gpt2), "
                                           "module:callable, or a Hub name whose config transformers can read")
    parser.add_argument("--library_name", choices=["timm", "transformers"], default=None,
                        help="the library of a Hub model (transformers; timm is not available in accel)")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES) + ["bfloat16"],
                        help="dtypes to size the model in (default: %(default)s)")
    parser.add_argument("--trust_remote_code", action="store_true", default=False,
                        help="let transformers run the model repository's own code (only for repositories you trust)")
    parser.add_argument("--token", default=None, help="Hugging Face token for a private Hub config")
    if subparsers is not None:
        parser.set_defaults(func=estimate_command)
    return parser


def add_timm_hub_prefix(model_name: str) -> str:
    """The `hf-hub:` source prefix timm needs for a Hub repo id; bare architectures and prefixed names unchanged."""
    return model_name if ":" in model_name or "/" not in model_name else f"hf-hub:{model_name}"


def verify_on_hub(repo: str, token: str | None = None):
    """The Hub's model info, "gated" (access refused), "repo" (no such repository), or None when the Hub cannot be
    asked (offline): then transformers' cache decides."""
    try:
        from huggingface_hub import model_info
        from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError
    except ImportError:
        return None
    try:
        return model_info(repo, token=token)
    except GatedRepoError:
        return "gated"
    except RepositoryNotFoundError:
        return "repo"
    except Exception:  # offline, no network: not an answer about the repository
        return None


def _is_local(model_name: str) -> bool:
    return Path(model_name).exists() or (":" in model_name and "/" not in model_name.split(":")[0])


def create_empty_model(model_name: str, library_name: str | None = None, trust_remote_code: bool = False,
                       access_token: str | None = None):
    """`model_name` as an nn.Module on the meta device (see the module docstring for the forms taken)."""
    from accel.planning.estimate import EstimateError, build_from_config, load_module

    if library_name == "timm":
        raise RuntimeError(f"Tried to load `{model_name}` with `timm`: timm models are not available in accel's "
                           "estimator; give a transformers config or module:callable")
    if _is_local(model_name):
        try:
            return load_module(model_name)
        except EstimateError as exc:
            raise ValueError(str(exc)) from None
    if "/" not in model_name:  # a model type such as gpt2
        try:
            return load_module(model_name)
        except EstimateError:
            pass
    found = verify_on_hub(model_name, access_token)
    if found == "gated":  # an OSError, as huggingface_hub's GatedRepoError is
        raise OSError(f"Repo for model `{model_name}` is gated; log in with a token that has access (--token), or "
                      "give its config.json")
    if found == "repo":
        raise OSError(f"Repo for model `{model_name}` does not exist on the Hub; allowed: a Hub model, a "
                      "config.json or its folder, a model type, or module:callable")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_name, trust_remote_code=trust_remote_code, token=access_token)
    return build_from_config(config)


def gather_data(args: argparse.Namespace) -> list[list]:
    """Accelerate's rows `[dtype, largest layer bytes, total bytes, training bytes (dict)]`, one per `args.dtypes`."""
    from accel.planning.estimate import spec_from_module, training
    from accel.big_model.modeling import calculate_maximum_sizes

    model = create_empty_model(args.model_name, library_name=getattr(args, "library_name", None),
                               trust_remote_code=getattr(args, "trust_remote_code", False),
                               access_token=getattr(args, "token", None))
    total, (largest, _) = calculate_maximum_sizes(model)
    adam = training(spec_from_module(model, args.model_name), 1)["layouts"]["ddp"]
    usage = {"model": adam["params_bytes"], "gradients": adam["grads_bytes"], "optimizer": adam["optimizer_bytes"],
             "step": adam["device_bytes"]}
    rows = []
    for dtype in args.dtypes:
        divisor = _DIVISOR[dtype]
        trains = dtype in ("float32", "float16", "bfloat16")
        rows.append([dtype, largest / divisor, total / divisor,
                     dict(usage) if trains else dict.fromkeys(usage, -1)])
    return rows


def _bytes(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(size) < 1024 or unit == "TB":
            return f"{size:.2f} {unit}" if unit != "B" else f"{size:.0f} B"
        size /= 1024
    return str(size)


def create_ascii_table(headers: list, rows: list, title: str) -> str:
    """A boxed table: the title over the headers and rows (every cell a string)."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) + 2 for i, h in enumerate(headers)]
    line = "+" + "+".join("-" * w for w in widths) + "+"
    inner = len(line) - 2

    def row(cells):
        # strict=False: a row may have more cells than there are headers
        return "|" + "|".join(str(c).center(w) for c, w in zip(cells, widths, strict=False)) + "|"

    return "\n".join([line, "|" + title[:inner].center(inner) + "|", line, row(headers), line,
                      *(row(r) for r in rows), line])


def estimate_command(args: argparse.Namespace) -> list[list]:
    """Print the table; return the rows as printed."""
    rows = []
    for dtype, largest, total, usage in gather_data(args):
        peak = max(usage.values())
        rows.append([dtype, _bytes(largest), _bytes(total), _bytes(peak) if peak != -1 else "N/A"])
    print(create_ascii_table(["dtype", "Largest Layer", "Total Size", "Training using Adam"], rows,
                             f"Memory Usage for loading `{args.model_name}`"))
    return rows


def main() -> int:
    from accel.commands.utils import run_main

    return run_main("accelerate estimate-memory", lambda: estimate_command(estimate_command_parser().parse_args()),
                    (ValueError, OSError, RuntimeError))


if __name__ == "__main__":
    raise SystemExit(main())
