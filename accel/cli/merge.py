"""`accel merge-weights CHECKPOINT_DIR OUTPUT_DIR`: merge a sharded checkpoint into one `model.safetensors`.

CHECKPOINT_DIR is accel's `save_state` folder (ZeRO-3 / FSDP2 runs write each parameter's slices per rank) or a
torch.distributed.checkpoint folder (`.metadata` + `*.distcp`, e.g. Accelerate's `pytorch_model_fsdp_0`); the
work is accel/checkpoint/merge.py's. One process, no GPU; it needs the memory of the full weights.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from accel.cli._common import UsageError, add_flag


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "merge-weights",
        help="merge a sharded checkpoint (save_state under ZeRO-3/FSDP2, or DCP .distcp files) into model.safetensors",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        allow_abbrev=False,
    )
    parser.add_argument("checkpoint_directory", metavar="CHECKPOINT_DIR",
                        help="accel's save_state folder, or a torch.distributed.checkpoint folder with .metadata")
    parser.add_argument("output_path", metavar="OUTPUT_DIR", help="folder for model.safetensors (created if missing)")
    add_flag(parser, "unsafe_serialization", action="store_true", default=False,
             help="accepted for Accelerate's command line; accel still writes safetensors (never pickle)")
    add_flag(parser, "remove_checkpoint_dir", action="store_true", default=False,
             help="delete the checkpoint (the whole save_state folder when given its state/) once the merged file "
                  "is written")
    parser.set_defaults(func=run)
    return parser


def check_path(name: str, text: str) -> None:
    """CHECKPOINT_DIR / OUTPUT_DIR names something the OS can look up (missing is fine: the merge says so, or
    creates the output): not empty, no NUL character, not too long, not behind a folder it may not read."""
    allowed = "allowed: a folder name"
    shown = repr(text if len(text) <= 60 else text[:57] + "...")
    if not text or "\x00" in text:
        raise UsageError(f"{name} {shown}: bad value; {allowed} (not empty, no NUL character)")
    try:
        os.stat(text)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as exc:
        raise UsageError(f"{name} {shown}: cannot be used ({exc.strerror or exc}); {allowed} the OS can open") from None


def run(args: argparse.Namespace) -> int:
    from accel.checkpoint.merge import MergeError, describe, merge_fsdp_weights

    check_path("CHECKPOINT_DIR", args.checkpoint_directory)
    check_path("OUTPUT_DIR", args.output_path)
    # safetensors either way; the note on --unsafe_serialization, and torch's warnings while reading (a damaged
    # file's unpickling notes), come after a merge, never before its one error line
    with warnings.catch_warnings(record=True) as caught:
        try:
            path = merge_fsdp_weights(args.checkpoint_directory, args.output_path,
                                      remove_checkpoint_dir=args.remove_checkpoint_dir)
        except MergeError as exc:
            raise UsageError(str(exc)) from None
    for note in caught:
        warnings.showwarning(note.message, note.category, note.filename, note.lineno)
    if args.unsafe_serialization:
        sys.stderr.write("accel merge-weights: --unsafe_serialization: accel never writes pickle files; "
                         "model.safetensors was written instead of pytorch_model.bin\n")
    if path is not None:  # None on the ranks that waited for rank 0's merge
        print(describe(path))
    return 0
