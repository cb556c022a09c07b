"""`save_state` where every process holds the whole training state (DDP, no sharding): the main process writes the
checkpoint on its own, so `save_state` may be called there alone, as Accelerate allows (diffusers' example scripts
call it under `if accelerator.is_main_process`), or on every process, as usual.

Another process that calls `save_state` says so at once in the process group's key-value store ("joined"), then
hands over its RNG states there (safetensors bytes and JSON, no pickle). The main process runs the ordinary save
(atomic, checksummed; asynchronous too) without a collective and, before the manifest, writes the RNG states of the
processes that joined within JOIN_WAIT seconds of its start; a process that joined is always waited for (one that
dies inside its save leaves the checkpoint unpublished, as under a collective save). The main process then announces
the outcome; a process whose states came too late adds them to the published folder itself (each file replaced
atomically, validated when read). A failed save of the main process is raised on the processes that called too, in
one line. A checkpoint saved by the main process alone has no RNG states for the other ranks: they keep their own
on load, with a warning (Accelerate: "Could not load random states")."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from accel.checkpoint.layout import CheckpointError

ANNOUNCE_POLL = 0.02  # seconds between two looks at the store
JOIN_WAIT = 2.0  # seconds the main process waits for the others to call save_state too ($ACCEL_SAVE_STATE_JOIN_WAIT)
_calls: dict[tuple[int, str], int] = {}  # (step, what) -> this process's calls of it at that step


def store():
    """The default process group's key-value store (None where there is none)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def announcement_key(step: int, tag: str = "save_state") -> str:
    """The same key on every process at its n-th `tag` call at `step` (not the folder: processes naming different
    folders meet under one key, and are told so in one line)."""
    count = _calls[(step, tag)] = _calls.get((step, tag), 0) + 1
    return f"accel/{tag}/{step}/{count}"


def different_folders(folders: dict[int, str]) -> CheckpointError:
    shown = ", ".join(f"rank {r}: {f}" for r, f in sorted(folders.items()))
    return CheckpointError(f"save_state: the processes named different folders ({shown}); allowed: the same folder "
                           "on every process (one folder they all see, e.g. on a shared disk)")


def timeout() -> timedelta:
    """How long a process waits for the others' part of a save: the process group's default (30 min), or
    $ACCEL_SAVE_STATE_TIMEOUT seconds."""
    from torch.distributed.constants import default_pg_timeout

    given = os.environ.get("ACCEL_SAVE_STATE_TIMEOUT", "").strip()
    try:
        return timedelta(seconds=float(given)) if given else default_pg_timeout
    except ValueError:
        raise CheckpointError(f"ACCEL_SAVE_STATE_TIMEOUT={given!r} is not a number of seconds; allowed: a positive "
                              "number, or unset (30 min)") from None


def join_everyone(kv, key: str, rank: int, world: int, what: str, target: Path) -> None:
    """Before a collective save: wait until every process has called save_state too, else one line naming those
    that did not (instead of a hang until the collective times out); they must name the same folder."""
    kv.set(f"{key}/joined/{rank}", str(target))
    limit = timeout()
    deadline = time.monotonic() + limit.total_seconds()
    keys = [f"{key}/joined/{r}" for r in range(world)]
    while not kv.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r in range(world) if not kv.check([keys[r]])]
            raise CheckpointError(f"save_state is collective under {what} (each process holds part of the state): "
                                  f"rank(s) {', '.join(map(str, missing))} did not call it within "
                                  f"{limit.total_seconds():.0f} s; allowed: call save_state on every process, "
                                  "not only under `if accelerator.is_main_process`")
        time.sleep(ANNOUNCE_POLL)
    folders = {r: kv.get(keys[r]).decode() for r in range(world)}
    if len(set(folders.values())) > 1:
        raise different_folders(folders)


def join_wait() -> float:
    given = os.environ.get("ACCEL_SAVE_STATE_JOIN_WAIT", "").strip()
    try:
        return float(given) if given else JOIN_WAIT
    except ValueError:
        raise CheckpointError(f"ACCEL_SAVE_STATE_JOIN_WAIT={given!r} is not a number of seconds; allowed: a number "
                              f"of seconds, or unset ({JOIN_WAIT:g})") from None


def encode_rng(snapshot: tuple[dict, dict]) -> bytes:
    """An RNG snapshot as bytes for the store: the safetensors of its tensors, then its JSON (no pickle)."""
    from safetensors.torch import save

    tensors, plain = snapshot
    packed = save(tensors)
    return len(packed).to_bytes(8, "little") + packed + json.dumps(plain).encode()


def decode_rng(blob: bytes) -> tuple[dict, dict]:
    from safetensors.torch import load

    size = int.from_bytes(blob[:8], "little")
    return load(blob[8:8 + size]), json.loads(blob[8 + size:].decode())


def collect_rng(kv, key: str, world: int, started: float, limit: timedelta,
                target: Path) -> dict[int, tuple[dict, dict]]:
    """(Main process, before the manifest.) The RNG states of the processes that joined: those that joined within
    the join wait of `started`, each waited for until it handed them over; a process that named another folder
    fails the save in one line."""
    found: dict[int, tuple[dict, dict]] = {}
    deadline = time.monotonic() + limit.total_seconds()
    for rank in range(1, world):
        joined, handed = f"{key}/joined/{rank}", f"{key}/rng/{rank}"
        while not kv.check([handed]):
            if not kv.check([joined]) and time.monotonic() > started + join_wait():
                break  # it did not call save_state (the main process saves alone)
            if time.monotonic() > deadline:
                raise CheckpointError(f"save_state: rank {rank} called save_state but did not hand over its RNG "
                                      f"states within {limit.total_seconds():.0f} s")
            time.sleep(ANNOUNCE_POLL)
        else:
            named = kv.get(joined).decode()
            if named != str(target):
                raise different_folders({0: str(target), rank: named})
            found[rank] = decode_rng(kv.get(handed))
    return found


def announce(kv, key: str, outcome: str) -> None:
    kv.set(key, outcome)


def wait_for_announcement(kv, key: str, timeout: timedelta) -> str:
    """The main process's outcome for `key`: 'ok <ranks whose RNG states it wrote>' or 'failed: <message>'."""
    deadline = time.monotonic() + timeout.total_seconds()
    while not kv.check([key]):
        if time.monotonic() > deadline:
            raise CheckpointError(f"save_state: the main process did not save {key.split('/', 4)[-1]} within "
                                  f"{timeout.total_seconds():.0f} s; allowed: call save_state on the main process "
                                  "(alone, or with the others)")
        time.sleep(ANNOUNCE_POLL)
    return kv.get(key).decode()


def follow_main_save(target: Path, rank: int, snapshot, write_rng, kv, key: str, timeout: timedelta) -> None:
    """Wait for the main process's outcome; where it wrote no RNG states for this rank (it joined too late), add
    them to the published checkpoint, file by file atomically. The main process's failure is raised here too."""
    outcome = wait_for_announcement(kv, key, timeout)
    if outcome.startswith("failed: "):
        raise CheckpointError(outcome.removeprefix("failed: "))
    if str(rank) in outcome.split()[1:]:
        return
    folder = target / "rng"
    staging = folder / f".rank_{rank}.{os.getpid()}.tmp"
    staging.mkdir()
    try:
        write_rng(staging, rank, snapshot)
        for file in sorted(staging.iterdir()):
            os.replace(file, folder / file.name)
    finally:
        for file in staging.iterdir() if staging.exists() else ():
            file.unlink()
        if staging.exists():
            staging.rmdir()


def done_future() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


def main_process_writes(tag: str, target, write, is_main: bool, replicated: bool) -> None:
    """Run `write()` on the main process; the processes that called too return once it is done. Where every process
    holds the whole state (`replicated`) that is said through the store, so a call on the main process alone (as
    Accelerate allows for `save` and `save_model`) does not hang; otherwise a barrier, as before. A failure of the
    main process's write is raised on the others too, in one line."""
    kv = store() if replicated and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 \
        else None
    if kv is None:
        if is_main:
            write()
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        return
    # the path in the key: a main-process-only call to another path is not this one
    key = announcement_key(-1, f"{tag}{os.path.abspath(str(target))}")
    if not is_main:
        outcome = wait_for_announcement(kv, key, timeout())
        if outcome != "ok":
            raise CheckpointError(outcome.removeprefix("failed: "))
        return
    try:
        write()
    except BaseException as exc:
        announce(kv, key, f"failed: {tag} to {target} failed on the main process ({type(exc).__name__}: {exc})"
                 .splitlines()[0])
        raise
    announce(kv, key, "ok")
