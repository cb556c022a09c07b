"""Checkpoint folders on disk: atomic publication, the manifest, numbering, rotation and validation.

A checkpoint is written into a hidden temporary folder beside its target (`.tmp-<name>-<host>-<pid>-<id>`),
every file is fsynced, the manifest `accel_checkpoint.json` is written last, and only then is the folder renamed
into place. A folder without a complete manifest is never a checkpoint, so a save killed at any moment leaves
the previous checkpoints intact and is never picked as the latest.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from accel.core.checked_file import CheckedFiles
from accel.core.safe_json import JSONFileError, read_json

MANIFEST = "accel_checkpoint.json"
MANIFEST_BYTES = 256 << 20  # a manifest lists every tensor (models and optimizer state): ~150 bytes each
FORMAT = "accel-checkpoint"
VERSION = 1
_NUMBERED = re.compile(r"^checkpoint_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint folder that is missing, incomplete or damaged; the message names the file."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """No complete checkpoint to resume from yet: `load_state()` on a first attempt. A FileNotFoundError, so
    `except FileNotFoundError: start fresh` works here and with Accelerate (whose `load_state()` raises one when
    the checkpoints folder does not exist)."""


@dataclass
class ProjectConfiguration:
    """Accelerate's `ProjectConfiguration`: where checkpoints go and how many are kept.

    With `automatic_checkpoint_naming`, `save_state()` writes `project_dir/checkpoints/checkpoint_<i>` with
    i = `iteration` (then incremented), keeps at most `total_limit` of them (oldest removed first), and
    `load_state()` with no path loads the latest complete one.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        self.set_directories(self.project_dir)
        if self.total_limit is not None and self.total_limit < 1:
            raise ValueError(f"ProjectConfiguration: total_limit={self.total_limit}; allowed: None or an integer >= 1")

    def set_directories(self, project_dir: str | None = None) -> None:
        """Set `project_dir`, and `logging_dir` to it where none was given (Accelerate's; Trainer calls it)."""
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def checkpoints_dir(self) -> Path:
        if not self.project_dir:
            raise ValueError("ProjectConfiguration: automatic_checkpoint_naming needs project_dir")
        return Path(self.project_dir) / "checkpoints"


# -- writing ----------------------------------------------------------------------------------------------

def temporary_sibling(target: Path) -> Path:
    """`.tmp-<name>-<host>-<pid>-<id>`: the owner is in the name, so a later clean-up can tell an abandoned one
    (its process is gone) from one another job is still writing."""
    return target.parent / f".tmp-{target.name}-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def fsync_tree(folder: Path) -> None:
    """Flush every file and folder under `folder` (and `folder` itself) to disk."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            fsync_file(Path(root) / name)
        fsync_dir(Path(root))


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: Path) -> None:
    """Flush a folder's entries (new names, renames); a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(directory: Path, final_name: str, write) -> Path:
    """Call ``write(tmp_path)``, fsync the result and rename it to ``final_name``; no temp file survives.

    Shared by model weights (`model_io`) and disk offload (`accel.big_model.offload`), so neither imports the other."""
    tmp = directory / f".{final_name}.{secrets.token_hex(6)}.tmp"
    try:
        write(tmp)
        fsync_file(tmp)
        final = directory / final_name
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    return final


def write_json(path: Path, obj) -> None:
    """Indented JSON with a final newline (index files people read)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()


# Files are checksummed with CRC-32 (zlib's polynomial, `crc32:<8 hex>` in the manifest), streamed in CHUNK-sized
# pieces; it finds every burst of up to 32 changed bits. `crc32` is isal's where the `isal` package is installed
# (`pip install accel-train[fast-checksums]`): the same values, computed with the CPU's carry-less multiply, about 5x
# zlib's speed on the 2-core machine of benchmarks/README.md, which keeps load_state's verification within 5% of a
# load; else zlib's. `save_state` computes the crc32 of its state/ files while writing them (streaming_writer.py), so
# only the small rng/ files are read again for the manifest. Checkpoints saved before hold `sha256:` checksums: both
# are verified.
CHECKSUM = "crc32"
CHUNK = 8 << 20
INLINE_CHECKSUMS = ".state-checksums.json"  # the writer's checksums, beside state/ until write_manifest takes them
_CHECKSUM_FORM = re.compile(r"^(?:crc32:[0-9a-f]{8}|sha256:[0-9a-f]{64})$")


_CHECK_VALUE = 0xCBF43926  # the CRC-32 of b"123456789", the standard check value


@functools.cache
def _crc32_function() -> Callable[..., int]:
    """isal's crc32 where it is installed and gives the standard check value, else zlib's (same results)."""
    try:
        from isal.isal_zlib import crc32 as fast
    except ImportError:
        return zlib.crc32
    try:
        if fast(b"123456789") == _CHECK_VALUE and fast(b"56789", fast(b"1234")) == _CHECK_VALUE:
            return fast
    except Exception:  # a broken build: zlib's is always right
        pass
    return zlib.crc32


def crc32(data: Any, value: int = 0) -> int:
    """The CRC-32 of `data` (bytes or a buffer) continuing from `value`, as `zlib.crc32` gives it; through isal's
    where installed. It releases the GIL on large buffers, so files are verified in threads beside other work."""
    return _crc32_function()(data, value)


def file_checksum(path: Path, algorithm: str = CHECKSUM, opened: CheckedFiles | None = None) -> str:
    """`crc32:<8 hex>` (or with `algorithm="sha256"`, `sha256:<64 hex>`) of a file's bytes, streamed in CHUNK
    pieces (the whole file is never in memory) through the descriptor checked to be a regular file (`opened`: the
    load's record, so the file is the one it checked before)."""
    if algorithm == "crc32":
        value, update = 0, _crc32_function()
        for chunk in _file_chunks(Path(path), opened):
            value = update(chunk, value)
        return f"crc32:{value:08x}"
    if algorithm == "sha256":
        digest = hashlib.sha256()
        for chunk in _file_chunks(Path(path), opened):
            digest.update(chunk)
        return f"sha256:{digest.hexdigest()}"
    raise ValueError(f"checksum algorithm {algorithm!r}; known: crc32, sha256")


_WINDOW = 8 * CHUNK  # bytes of a file mapped at a time


def checked_files() -> CheckedFiles:
    """A load's record of the files it opens (accel.core.checked_file): each is opened without blocking and checked
    on its descriptor, and a file opened again in the same load must be the one first checked."""
    return CheckedFiles(CheckpointError, "a regular file (a checkpoint holds only regular files and folders)")


def _file_chunks(path: Path, opened: CheckedFiles | None = None):
    """A file's bytes in CHUNK pieces, read through one checked descriptor (a pipe or device that took the file's
    name is one CheckpointError, never a hang): through a memory map, in _WINDOW windows (no copy out of the page
    cache: crc32 then runs 1.5x as fast as over read() buffers), else read into one reused buffer."""
    with (opened or checked_files()).open(path) as checked:
        yield from checked.chunks(CHUNK, _WINDOW)


def verify_file_checksum(path: Path | str, expected: str, opened: CheckedFiles | None = None) -> bool:
    """Whether the file's bytes match `expected`, a checksum as a manifest lists it: `crc32:<8 hex>` (what accel
    writes) or `sha256:<64 hex>` (checkpoints saved before). ValueError for any other form; CheckpointError for a
    file that is not a regular file (read through its checked descriptor; `opened`: the load's record)."""
    if not isinstance(expected, str) or not _CHECKSUM_FORM.match(expected):
        raise ValueError(f"checksum {expected!r}; allowed: crc32:<8 hex digits> or sha256:<64 hex digits>")
    return file_checksum(Path(path), expected.partition(":")[0], opened) == expected


def manifest_checksum(manifest: dict, algorithm: str = CHECKSUM) -> str:
    """The checksum of the manifest's own content (every key but `checksum`), over its canonical JSON: a same-size
    edit of any value (a seed, a scheduler's last_epoch) is found."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    if algorithm == "sha256":
        return f"sha256:{hashlib.sha256(text).hexdigest()}"
    if algorithm == "crc32":
        return f"crc32:{zlib.crc32(text):08x}"
    raise ValueError(f"checksum algorithm {algorithm!r}; known: crc32, sha256")


def file_checksums(folder: Path, names: list[str], algorithms: dict[str, str] | None = None) -> dict[str, str]:
    """Checksums of several files (each with its algorithm in `algorithms`, default CHECKSUM), in threads (zlib and
    hashlib release the GIL on large buffers)."""
    from concurrent.futures import ThreadPoolExecutor

    algorithms = algorithms or {}

    def one(rel: str) -> str:
        return file_checksum(folder / rel, algorithms.get(rel, CHECKSUM))

    if len(names) <= 1:
        return {rel: one(rel) for rel in names}
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1, len(names))) as pool:
        return dict(zip(names, pool.map(one, names), strict=True))


def _inline_checksums(folder: Path) -> dict[str, tuple[int, str]]:
    """The checksums the writer computed while writing (file -> (size, checksum)), taken out of the folder; {}
    where there are none (or they cannot be read: every file is then hashed here)."""
    path = folder / INLINE_CHECKSUMS
    try:
        found = read_json(path)["files"]
    except (JSONFileError, KeyError, TypeError):
        found = {}
    finally:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    if not isinstance(found, dict):
        return {}
    return {rel: (entry["size"], entry["checksum"]) for rel, entry in found.items()
            if isinstance(entry, dict) and type(entry.get("size")) is int
            and isinstance(entry.get("checksum"), str) and _CHECKSUM_FORM.match(entry["checksum"])}


def write_manifest(folder: Path, content: dict) -> None:
    """List every file with its size and checksum, then write the manifest (with its own checksum) atomically: it
    marks the folder complete. The checksums the writer computed while writing (INLINE_CHECKSUMS) are used for
    the files whose size they name; only the other files are read here."""
    inline = _inline_checksums(folder)
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            files[path.relative_to(folder).as_posix()] = path.stat().st_size
    known = {rel: inline[rel][1] for rel, size in files.items() if rel in inline and inline[rel][0] == size}
    hashed = file_checksums(folder, [rel for rel in files if rel not in known])
    manifest = {"format": FORMAT, "version": VERSION, **content, "files": files,
                "checksums": {rel: known.get(rel) or hashed[rel] for rel in files}}
    manifest["checksum"] = manifest_checksum(manifest)
    tmp = folder / f".{MANIFEST}.tmp"
    with open(tmp, "w") as fh:
        json.dump(manifest, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, folder / MANIFEST)
    fsync_dir(folder)


def publish(tmp: Path, target: Path) -> None:
    """Put the complete temporary folder at `target` in one step (replacing an older checkpoint of the same name),
    holding the publish lock of `target`'s folder, then remove the replaced one."""
    with PublishLock(target):
        old = swap_in(tmp, target)
        fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


PUBLISH_LOCK = ".accel-publish.lock"  # the lock file, only where a folder itself cannot be locked (NFS)


class PublishLock:
    """An exclusive advisory lock (`fcntl.flock`) for replacing folders in `target`'s parent folder: every publish
    (save_state, save_model) takes it, so two jobs replacing the same folder (or siblings) take turns and neither
    sees, moves aside or removes the other's half-done swap. The lock is on the parent folder itself, so nothing is
    left behind; where the filesystem refuses to lock a folder (NFS emulates flock with POSIX locks, which need a
    file open for writing) it is on `.accel-publish.lock` in the parent, which is never removed (removing a lock
    file in use would let two jobs hold it). Released when the block ends or the process dies. No lock on Windows
    or where the filesystem has none (Lustre without `-o flock`): replaces there are not serialised."""

    def __init__(self, target: Path):
        self.parent = Path(target).parent
        self.fd: int | None = None

    def __enter__(self) -> PublishLock:
        try:
            import fcntl
        except ImportError:  # Windows
            return self
        for path, flags in ((self.parent, os.O_RDONLY), (self.parent / PUBLISH_LOCK, os.O_RDWR | os.O_CREAT)):
            try:
                fd = os.open(path, flags, 0o666)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                os.close(fd)
                continue
            self.fd = fd
            break
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
            self.fd = None


def swap_in(tmp: Path, target: Path) -> Path | None:
    """Put the folder `tmp` at `target`; returns where the folder it replaced now is (the caller removes it), None
    when there was none. On Linux both names are exchanged in one step (renameat2 RENAME_EXCHANGE: `target` names a
    complete folder at every moment, and the old one ends at `tmp`, a temporary a later save removes once provably
    abandoned); elsewhere, or on a filesystem without it (NFS), the old folder is renamed aside to
    `.old-<name>-<id>` first and put back if the second rename fails (a process killed between the two renames
    leaves it there, which `read_manifest` names). Call it holding the `PublishLock` of `target`."""
    if not os.path.lexists(target):
        try:
            os.rename(tmp, target)
            return None
        except OSError:
            if not os.path.lexists(target):
                raise  # else another process created it meanwhile: replace it below
    if _exchange(tmp, target):
        return tmp
    old = target.parent / f".old-{target.name}-{uuid.uuid4().hex[:8]}"
    os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:  # put the previous folder back under its name
        os.replace(old, target)
        raise
    return old


_RENAMEAT2: list = []  # [libc's renameat2 or None], looked up once


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (Linux renameat2 with RENAME_EXCHANGE); False where that is unavailable."""
    import errno
    import sys

    if not _RENAMEAT2:
        func = None
        if sys.platform.startswith("linux"):
            import ctypes

            try:
                func = ctypes.CDLL(None, use_errno=True).renameat2
                func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                func.restype = ctypes.c_int
            except (OSError, AttributeError):  # a libc without it (glibc < 2.28)
                func = None
        _RENAMEAT2.append(func)
    func = _RENAMEAT2[0]
    if func is None:
        return False
    import ctypes

    at_fdcwd, rename_exchange = -100, 2
    if func(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


_HOST = re.sub(r"[^A-Za-z0-9.]", "_", os.uname().nodename if hasattr(os, "uname") else "host") or "host"
_OWNED_TEMPORARY = re.compile(r"^\.tmp-.+-(?P<host>[A-Za-z0-9._]+)-(?P<pid>\d+)-[0-9a-f]{8}$")
_OWNER = re.compile(r"^[A-Za-z0-9._]+-\d+-[0-9a-f]{8}$")  # what follows `.tmp-<name>-` in an owner-named one
ABANDONED_AFTER = 600.0  # seconds without a write before a dead owner's temporary folder may be removed
UNOWNED_AFTER = 86400.0  # a temporary folder of an older accel (no owner in its name): a day without a write


def remove_stale_temporaries(parent: Path, name: str | None = None) -> None:
    """Remove the temporary folders of interrupted saves beside a new one, and only those provably abandoned:
    written on this host by a process that no longer runs, nothing written for ABANDONED_AFTER seconds (a folder
    of an accel before owners were named: UNOWNED_AFTER). Another job's save in progress (a sibling folder, or
    the same one) is never touched; nor is a folder another host writes (its processes cannot be seen from here).
    With `name`: only the owner-named temporaries of saves to `name` (`.tmp-<name>-<host>-<pid>-<id>`), for a
    folder such as save_model's parent, which may hold anything."""
    if not parent.is_dir():
        return
    prefix = ".tmp-" if name is None else f".tmp-{name}-"
    for path in parent.iterdir():
        if not path.name.startswith(prefix) or not path.is_dir():
            continue
        if name is not None and not _OWNER.match(path.name[len(prefix):]):
            continue
        if _abandoned(path):
            shutil.rmtree(path, ignore_errors=True)


def _abandoned(path: Path) -> bool:
    match = _OWNED_TEMPORARY.match(path.name)
    if match is None:
        return _idle_for(path) > UNOWNED_AFTER
    if match["host"] != _HOST or _process_runs(int(match["pid"])):
        return False
    return _idle_for(path) > ABANDONED_AFTER


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # it exists (another user's), or cannot be asked: assume it runs
    return True


def _idle_for(path: Path) -> float:
    """Seconds since anything in the folder was last written (a save writing one large file keeps it fresh)."""
    newest = 0.0
    for root, _dirs, files in os.walk(path):
        for name in [".", *files]:
            try:
                newest = max(newest, os.stat(os.path.join(root, name)).st_mtime)
            except OSError:
                pass
    return time.time() - newest


# -- numbering --------------------------------------------------------------------------------------------

def numbered_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Complete `checkpoint_<i>` folders, oldest first (folders without a manifest are ignored)."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _NUMBERED.match(path.name)
        if match and path.is_dir() and (path / MANIFEST).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(folder: Path) -> Path:
    found = numbered_checkpoints(folder)
    if not found:
        raise NoCheckpointError(f"{folder}: no complete checkpoint_<i> folder to load yet (each needs {MANIFEST}); "
                                "to start fresh when there is none, catch FileNotFoundError")
    return found[-1][1]


def rotate(folder: Path, total_limit: int | None) -> None:
    """Remove the oldest complete checkpoints beyond `total_limit`, each out of sight first (`remove_folder`)."""
    if total_limit is None:
        return
    found = numbered_checkpoints(folder)
    for _, path in found[: max(len(found) - total_limit, 0)]:
        remove_folder(path)


def remove_folder(path: Path) -> None:
    """Delete a checkpoint folder without a reader ever seeing it half-deleted: it leaves its name in one rename, to
    a hidden temporary sibling (`.tmp-<name>-<host>-<pid>-<id>`, which `latest_checkpoint` and every loader ignore,
    and which a later save removes if this process dies before it does), and only then is it deleted. A folder
    already gone (another process rotated it) is fine; one that cannot be renamed is left whole, with a warning."""
    hidden = temporary_sibling(Path(path))
    try:
        os.rename(path, hidden)
    except FileNotFoundError:
        return
    except OSError as exc:
        import warnings

        warnings.warn(f"{path}: not removed ({exc.strerror or exc}): it could not be renamed out of sight first, and "
                      "removing it in place could show a reader a partial checkpoint", stacklevel=2)
        return
    fsync_dir(hidden.parent)
    shutil.rmtree(hidden, ignore_errors=True)


# -- reading ----------------------------------------------------------------------------------------------

def read_manifest(folder: Path, share: tuple[int, int] = (0, 1), verify_files: bool = True,
                  opened: CheckedFiles | None = None) -> dict:
    """The manifest of a complete checkpoint, after checking every listed file is there with its size, the
    manifest's own checksum, and the checksums of the files: of every `world`-th one from `rank` for
    `share=(rank, world)` (the processes of a load verify a share each). A manifest written before checksums
    (or by hand, without them) is checked by sizes only. With `verify_files=False` the files' checksums are checked
    for their form only: the caller verifies the bytes with `FileVerification` (while it reads them). Each file is
    checked on an opened descriptor; `opened` (the load's `checked_files()`) then holds what every later read of the
    load must find again."""
    folder = Path(folder)
    if not folder.is_dir():
        interrupted = sorted(folder.parent.glob(f".old-{folder.name}-*")) if folder.parent.is_dir() else []
        hint = f"; an interrupted save left the previous checkpoint at {interrupted[-1]}" if interrupted else ""
        raise CheckpointError(f"{folder}: checkpoint folder not found{hint}")
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; {folder} is not a complete accel checkpoint (partial or foreign)")
    regular_file(folder, MANIFEST, path)
    try:
        manifest = read_json(path, max_bytes=MANIFEST_BYTES, top=None)  # bounded: integers, depth, each key once
    except JSONFileError as exc:
        raise CheckpointError(str(exc).replace(f"{path}: ", f"{path}: damaged: ", 1)) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an accel checkpoint manifest")
    version = manifest.get("version", 0)
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointError(f"{path}: written by a newer accel (format version {version!r})")
    files = manifest.get("files", {})
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: damaged ('files' is {type(files).__name__}, expected a mapping)")
    opened = opened or checked_files()
    for rel, size in files.items():
        file, actual = regular_file(folder, rel, path, opened)
        if type(size) is not int or actual != size:
            raise CheckpointError(f"{file}: damaged (size {actual} bytes, expected {size!r})")
    _verify_checksums(folder, path, manifest, files, share if verify_files else (0, 0), opened)
    return manifest


def _verify_checksums(folder: Path, path: Path, manifest: dict, files: dict, share: tuple[int, int],
                      opened: CheckedFiles) -> None:
    """The manifest's own checksum, then the checksums of this process's share of the files; crc32 (accel's) and
    sha256 (checkpoints saved before) are both verified."""
    saved = manifest.get("checksum")
    if saved is not None:
        if not isinstance(saved, str) or not _CHECKSUM_FORM.match(saved):
            raise CheckpointError(f"{path}: damaged (its checksum is {str(saved)[:80]!r}; allowed: crc32:<8 hex "
                                  "digits> or sha256:<64 hex digits>)")
        if saved != manifest_checksum(manifest, saved.partition(":")[0]):
            raise CheckpointError(f"{path}: damaged (its content does not match its checksum: edited or corrupted)")
    checksums = manifest.get("checksums")
    if checksums is None:
        return
    if not isinstance(checksums, dict) or set(checksums) != set(files):
        raise CheckpointError(f"{path}: damaged ('checksums' does not list exactly the files of 'files')")
    for rel, expected in checksums.items():
        if not isinstance(expected, str) or not _CHECKSUM_FORM.match(expected):
            raise CheckpointError(f"{path}: damaged (the checksum of {rel} is {str(expected)[:80]!r}; allowed: "
                                  "crc32:<8 hex digits> or sha256:<64 hex digits>)")
    rank, world = share
    if world:
        FileVerification(folder, manifest, share, opened).result()


def _listed_size(sizes: dict, rel: str) -> int:
    size = sizes.get(rel)
    return size if type(size) is int else 0


def _share(files, share: tuple[int, int]) -> list[str]:
    rank, world = share
    return sorted(files)[rank::world] if world else []


class FileVerification:
    """The checksums of this process's share of a checkpoint's files (as `read_manifest` verifies them), computed in
    threads from the moment it is made, so that the load reads the tensors meanwhile; `result()` waits and raises
    the CheckpointError of the first damaged file (in name order), `stop()` abandons what is left. zlib and hashlib
    release the GIL on large buffers: the hashing runs beside the main thread's reading. A manifest without
    checksums verifies nothing. Each file is read through a checked descriptor (`opened`: the load's record, so it
    is the file the load checked first)."""

    def __init__(self, folder: Path, manifest: dict, share: tuple[int, int] = (0, 1),
                 opened: CheckedFiles | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._folder, self._stopped, self._opened = Path(folder), False, opened or checked_files()
        sizes = manifest.get("files") or {}
        checksums = manifest.get("checksums") or {}
        self._expected = {rel: checksums[rel] for rel in _share(checksums, share)}
        self._futures: dict = {}
        self._pool = None
        if self._expected:
            workers = min(4, os.cpu_count() or 1, len(self._expected))
            self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="accel-verify")
            # the largest files first: the threads finish together
            order = sorted(self._expected, key=lambda rel: -_listed_size(sizes, rel))
            self._futures = {rel: self._pool.submit(self._matches, rel) for rel in order}
            self._pool.shutdown(wait=False)

    def _matches(self, rel: str) -> bool:
        expected = self._expected[rel]
        algorithm = expected.partition(":")[0]
        if algorithm == "crc32":
            value, update = 0, _crc32_function()
            for chunk in _file_chunks(self._folder / rel, self._opened):
                if self._stopped:
                    return True
                value = update(chunk, value)
            return f"crc32:{value:08x}" == expected
        return file_checksum(self._folder / rel, algorithm, self._opened) == expected

    def result(self) -> None:
        for rel in sorted(self._futures):
            if not self._futures[rel].result():
                raise CheckpointError(f"{self._folder / rel}: damaged (its bytes do not match the checksum in "
                                      f"{MANIFEST}: corrupted or changed since the save)")

    def stop(self) -> None:
        self._stopped = True
        for future in self._futures.values():
            future.cancel()


def regular_file(folder: Path, rel, manifest: Path, opened: CheckedFiles | None = None) -> tuple[Path, int]:
    """`folder/rel` and its size, for a manifest entry naming a regular file inside `folder`: no absolute path, no
    '..', no backslash (checked on the name, so the manifest cannot point outside), and what the name reaches is a
    regular file under folders, never a device or pipe (reading would not end, or block). Links inside the folder
    are followed, as every loader follows them: a checkpoint downloaded with huggingface_hub is a folder of links
    into ../../blobs. The file itself is checked on an opened descriptor (opened without blocking), recorded in
    `opened` so that the load's later reads find the same file."""
    parts = PurePosixPath(rel).parts if isinstance(rel, str) and rel and "\\" not in rel and "\0" not in rel else ()
    if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
        raise CheckpointError(f"{manifest}: file entry {rel!r} is not inside the checkpoint; allowed: relative "
                              "paths without '..'")
    path = folder
    for i, part in enumerate(parts):
        path = path / part
        try:
            mode = os.stat(path)
        except FileNotFoundError:
            link = " (a link to nothing)" if os.path.islink(path) else ""
            raise CheckpointError(f"{path}: missing from checkpoint {folder}{link}") from None
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot be read ({exc.strerror})") from None
        wanted, kind = (stat.S_ISREG, "a regular file") if i == len(parts) - 1 else (stat.S_ISDIR, "a folder")
        if not wanted(mode.st_mode):
            raise CheckpointError(f"{path}: not {kind}; a checkpoint holds only regular files and folders")
    with (opened or checked_files()).open(path) as checked:  # the name may have changed since the stat above
        return path, checked.size
