"""Helpers for the tests of files that change under a reader: a file replaced right after a check returns (the race
made deterministic), and a guard that turns a hang into a failure instead of a stuck test run."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

SWAPS = ("fifo", "device", "short")
HANG_SECONDS = 20.0


def replace(target: Path, kind: str) -> None:
    """Put in `target`'s place, in one rename, a FIFO, a link to /dev/zero, or a copy of it cut to half its size (a
    new file): a reader sees the old file or the new one, never no file."""
    new = target.with_name(f".swap-{target.name}")
    if kind == "fifo":
        os.mkfifo(new)
    elif kind == "device":
        new.symlink_to("/dev/zero")
    else:
        data = target.read_bytes()
        new.write_bytes(data[: len(data) // 2])
    os.rename(new, target)


def swap_after(monkeypatch, owner, name: str, target: Path, kind: str, when=lambda *a, **k: True,
               calls: int = 1) -> list:
    """Wrap `owner.name` so that once it returned for the `calls`-th time with `when(args)` true, `target` is replaced
    (`replace`): the file changes right after the check, before the read. Returns a list that holds True once the
    swap happened."""
    original, seen, done = getattr(owner, name), [], []

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        if not done and when(*args, **kwargs):
            seen.append(True)
            if len(seen) == calls:
                done.append(True)
                replace(target, kind)
        return result

    monkeypatch.setattr(owner, name, wrapper)
    return done


def finishes(call, *fifo_folders: Path):
    """Run `call()` in a thread and return what it returned (or raise what it raised); a call still running after
    HANG_SECONDS fails the test, after unblocking a reader stuck opening a FIFO under `fifo_folders` (opening it
    for writing releases the open; closing it ends the read)."""
    box: dict = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 (handed to the test's thread)
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_SECONDS)
    if thread.is_alive():
        for folder in fifo_folders:
            _release_fifos(folder)
        raise AssertionError(f"still reading after {HANG_SECONDS:.0f} s: a FIFO or device in a file's place hung it")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _release_fifos(folder: Path) -> None:
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if not stat.S_ISFIFO(os.lstat(path).st_mode):
                continue
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO: nobody is opening it
            except OSError:
                pass
