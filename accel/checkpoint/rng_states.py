"""Each rank's RNG states in a checkpoint (`rng/rank_<r>.safetensors` and `.json`): taken, written, read back
checked, and applied last, so nothing draws after them.
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path
from typing import Any

import torch

from accel.checkpoint import layout, tree
from accel.checkpoint.layout import CheckpointError
from accel.core.safe_json import parse_json
from accel.checkpoint.rank_agreement import first_cause


# -- RNG states, per rank ---------------------------------------------------------------------------------

def rng_snapshot() -> tuple[dict, dict]:
    """This process's RNG states now: (tensors, plain JSON values)."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, st in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = st
    plain: dict[str, Any] = {"python": tree.split(random.getstate(), "python", {})}
    try:
        import numpy as np

        plain["numpy"] = tree.split(np.random.get_state(), "numpy", {})
    except ImportError:
        pass
    return tensors, plain


def write_rng(folder: Path, rank: int, snapshot: tuple[dict, dict]) -> None:
    from safetensors.torch import save_file

    tensors, plain = snapshot
    save_file(tensors, str(folder / f"rank_{rank}.safetensors"))
    (folder / f"rank_{rank}.json").write_text(json.dumps(plain))


def _save_rng(folder: Path, rank: int) -> None:
    write_rng(folder, rank, rng_snapshot())


_RNG_BYTES = 1 << 20  # an RNG file: a few KB (torch's state, one per GPU, Python's and NumPy's)


def _read_rng(folder: Path, rank: int, manifest: dict, opened: Any = None) -> dict | None:
    """This rank's RNG states, read and tried on fresh generators (so a damaged one fails here, before anything
    is loaded); None where the checkpoint has none for this rank. Each file is read whole through a descriptor
    checked to be a regular file of the size the manifest lists (where it lists one), of at most _RNG_BYTES."""
    from safetensors.torch import load as load_safetensors

    saved_world = manifest["world_size"]
    if rank >= saved_world:
        warnings.warn(f"load_state: checkpoint has RNG states for {saved_world} processes; rank {rank} keeps its own",
                      stacklevel=1)
        return None
    written = manifest.get("rng_ranks")
    if isinstance(written, list) and rank not in written and not all(  # a late joiner adds its own after publishing
            (folder / "rng" / f"rank_{rank}.{ext}").is_file() for ext in ("safetensors", "json")):
        warnings.warn(f"load_state: {folder} was saved by the main process alone (save_state called there only): no "
                      f"RNG states for rank {rank}, which keeps its own", stacklevel=1)
        return None
    opened = opened or layout.checked_files()
    tensors_file, _ = layout.regular_file(folder, f"rng/rank_{rank}.safetensors", folder / layout.MANIFEST, opened)
    json_file, _ = layout.regular_file(folder, f"rng/rank_{rank}.json", folder / layout.MANIFEST, opened)
    raw = _rng_bytes(folder, f"rng/rank_{rank}.safetensors", manifest, opened)
    try:
        tensors = load_safetensors(raw)
        cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda_")), key=lambda k: int(k[5:]))]
        for state in [tensors["torch"], *cuda]:
            if state.dtype != torch.uint8 or state.dim() != 1:
                raise ValueError(f"an RNG state of dtype {state.dtype} and shape {list(state.shape)}")
        torch.Generator().set_state(tensors["torch"])
    except Exception as exc:
        raise CheckpointError(f"{tensors_file}: damaged ({first_cause(exc)})") from None
    text = _rng_bytes(folder, f"rng/rank_{rank}.json", manifest, opened)
    try:
        plain = parse_json(text, str(json_file), error=CheckpointError)
    except CheckpointError as exc:
        raise CheckpointError(str(exc).replace(f"{json_file}: ", f"{json_file}: damaged: ", 1)) from None
    try:
        return rng_state(tensors, plain, checked=True)
    except tree.BadTree as exc:
        raise CheckpointError(f"{json_file}: damaged ({exc})") from None
    except Exception as exc:
        raise CheckpointError(f"{json_file}: damaged ({first_cause(exc)})") from None


def _rng_bytes(folder: Path, rel: str, manifest: dict, opened) -> bytes:
    """A rank's RNG file, whole: of the size the manifest lists for it (a late joiner's is not listed), of at most
    _RNG_BYTES."""
    listed = manifest["files"].get(rel)
    with opened.open(folder / rel, size=listed if type(listed) is int else None, max_bytes=_RNG_BYTES) as checked:
        return checked.read()


def rng_state(tensors: dict, plain: dict, checked: bool = False) -> dict:
    """An `rng_snapshot()` (tensors, plain JSON values) as `_apply_rng` takes it; `checked`: the Python and NumPy
    states tried on fresh generators first (a damaged one fails here)."""
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda_")), key=lambda k: int(k[5:]))]
    python = tree.join(plain["python"], {}, ("python",))
    numpy = None
    try:
        numpy = tree.join(plain["numpy"], {}, ("numpy",)) if "numpy" in plain else None
        if checked:
            random.Random().setstate(python)
            if numpy is not None:
                import numpy as np

                np.random.RandomState().set_state(numpy)
    except ImportError:
        numpy = None
    return {"torch": tensors["torch"], "cuda": cuda, "python": python, "numpy": numpy}


def _apply_rng(rng: dict | None) -> None:
    """Restore this rank's RNG states (last, so nothing else draws after them)."""
    if rng is None:
        return
    random.setstate(rng["python"])
    if rng["numpy"] is not None:
        import numpy as np

        np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"][: torch.cuda.device_count()])
