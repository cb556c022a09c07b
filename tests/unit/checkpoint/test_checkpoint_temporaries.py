"""A save cleans up only the temporary folders of saves provably abandoned (owner process dead on this host, idle
long enough): another job's save in progress beside it, or into the same folder, is never touched."""

import os
import subprocess
import sys
import time

import torch

from accel import Accelerator
from accel.checkpoint import layout


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _folder(parent, name: str, age: float = 0.0):
    path = parent / name
    (path / "state").mkdir(parents=True)
    (path / "state" / "shard.safetensors").write_bytes(b"x")
    then = time.time() - age
    for p in (path / "state" / "shard.safetensors", path / "state", path):
        os.utime(p, (then, then))
    return path


def test_only_abandoned_temporaries_are_removed(tmp_path):
    host, old = layout._HOST, layout.ABANDONED_AFTER + 60
    running = _folder(tmp_path, f".tmp-other-{host}-{os.getppid()}-0123abcd", age=old)  # a live job, idle a while
    dead_fresh = _folder(tmp_path, f".tmp-other-{host}-{_dead_pid()}-0123abce")  # its owner just died: may be a
    dead_old = _folder(tmp_path, f".tmp-other-{host}-{_dead_pid()}-0123abcf", age=old)  # ... pid namespace's twin
    other_host = _folder(tmp_path, f".tmp-other-elsewhere-{_dead_pid()}-0123abd0", age=old)
    legacy_young = _folder(tmp_path, ".tmp-other-0123abd1", age=old)
    legacy_old = _folder(tmp_path, ".tmp-other-0123abd2", age=layout.UNOWNED_AFTER + 60)
    layout.remove_stale_temporaries(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {
        p.name for p in (running, dead_fresh, other_host, legacy_young)}
    assert not dead_old.exists() and not legacy_old.exists()


def test_a_save_keeps_a_sibling_jobs_save_in_progress(tmp_path):
    """Two jobs saving to sibling folders: the other job's temporary folder (its owner alive) survives this save."""
    other = _folder(tmp_path, layout.temporary_sibling(tmp_path / "job_b").name)  # this process: alive
    assert layout._OWNED_TEMPORARY.match(other.name)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    assert model is not None
    accelerator.save_state(str(tmp_path / "job_a"))
    assert other.is_dir() and (other / "state" / "shard.safetensors").read_bytes() == b"x"
    assert (tmp_path / "job_a" / layout.MANIFEST).is_file()


def test_swap_in_without_exchange_puts_the_old_folder_back_when_the_second_rename_fails(tmp_path, monkeypatch):
    """Where renameat2's exchange is unavailable (NFS, not Linux), the old folder is renamed aside first; if the new
    one then cannot be renamed into place, the old one goes back under its name and nothing is lost."""
    target, tmp = tmp_path / "ckpt", tmp_path / ".tmp-ckpt-x"
    (target / "old").mkdir(parents=True)
    (tmp / "new").mkdir(parents=True)
    monkeypatch.setattr(layout, "_exchange", lambda a, b: False)
    real_replace = os.replace

    def failing_replace(src, dst):
        if os.path.basename(src).startswith(".tmp-"):
            raise OSError(5, "Input/output error", str(src))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    try:
        layout.swap_in(tmp, target)
    except OSError as exc:
        assert exc.errno == 5
    else:
        raise AssertionError("the failing rename did not raise")
    assert (target / "old").is_dir() and (tmp / "new").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-ckpt-x", "ckpt"]  # no .old- folder left
    monkeypatch.setattr(os, "replace", real_replace)
    assert layout.swap_in(tmp, target).name.startswith(".old-ckpt-")  # and a working rename replaces it
    assert (target / "new").is_dir()
