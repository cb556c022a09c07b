"""Reading a file through the descriptor that was checked, never through its name a second time.

A check by name (`os.stat`, `Path.is_file()`) and a later `open(name)` may see two different files: a file
replaced in between by a FIFO makes `open()` block until a writer comes (forever), a link to /dev/zero reads
forever, a shorter file ends early. `open_checked(path)` opens the name once, without blocking (O_NONBLOCK, cleared
once the descriptor is known to be a regular file), checks that descriptor with `os.fstat` (a regular file, of the
size a manifest or header declares where one does) and every read then goes through it, inside that size:

* `read(offset, length)`: bytes read with pread; a file shorter than its checked size is one error line;
* `chunks()`: the whole file in pieces (a checksum), through memory-mapped windows or one reused buffer;
* `name`: `/proc/self/fd/<fd>` (or `/dev/fd/<fd>`), which opens the very file this descriptor holds, for readers
  that take only a name (safetensors' `safe_open` maps the file itself: a large file is never read into memory).
  Where neither exists (Windows) it is the path itself.

`CheckedFiles` is one load's record of the files it opened: a file opened again later in the same load (the checksum
thread, the header check, the tensor reader) must be the same file (device, inode, size, modification time) as at
its first open, so the bytes read are the bytes checked. Every refusal is `error(one line)` naming the file, the
bad value and what is allowed.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALLOWED = "a regular file"
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISDIR, "a folder"), (stat.S_ISSOCK, "a socket"))


@dataclass(frozen=True)
class Identity:
    """What tells one file from another that later took its name."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, info: os.stat_result) -> Identity:
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


class CheckedFile:
    """A regular file opened once (`open_checked`); read it only through this object."""

    def __init__(self, path: Path, fd: int, info: os.stat_result, error: type[Exception]):
        self.path, self.fd, self.size, self.error = path, fd, info.st_size, error
        self.identity = Identity.of(info)

    def __enter__(self) -> CheckedFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def name(self) -> str:
        """A name that opens this very file (the descriptor's, not the path's), while this object is open."""
        folder = _fd_folder()
        return str(self.path) if folder is None else f"{folder}/{self.fd}"

    def read(self, offset: int = 0, length: int | None = None) -> bytes:
        """`length` bytes from `offset` (default: to the checked size), never past the checked size."""
        length = self.size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > self.size:
            raise self.error(f"{self.path}: bytes {offset}-{offset + length} lie past its end ({self.size} bytes); "
                             "allowed: reads inside the file")
        parts, done = [], 0
        while done < length:
            data = self._pread(min(length - done, 1 << 30), offset + done)
            if not data:
                raise self._short(offset + done)
            parts.append(data)
            done += len(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_into(self, buffer: Any, offset: int = 0) -> None:
        """Fill `buffer` (anything writable with the buffer protocol) with the bytes from `offset`: a tensor's bytes
        land in its own memory, without a second copy."""
        view, done = memoryview(buffer).cast("B"), 0
        if offset < 0 or offset + len(view) > self.size:
            raise self.error(f"{self.path}: bytes {offset}-{offset + len(view)} lie past its end ({self.size} bytes)"
                             "; allowed: reads inside the file")
        while done < len(view):
            data = self._pread(min(len(view) - done, 1 << 30), offset + done)
            if not data:
                raise self._short(offset + done)
            view[done:done + len(data)] = data
            done += len(data)

    def chunks(self, chunk: int, window: int) -> Iterator[memoryview]:
        """The file's checked size in `chunk`-byte pieces: through memory maps of `window` bytes (no copy out of the
        page cache), else read into one reused buffer. A file that ends early is one error line (a map is made only
        while the file still holds the window: a page past its end would be a SIGBUS)."""
        start = 0
        window = -(-window // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY  # map offsets are aligned
        if self.size and hasattr(mmap, "MAP_POPULATE"):
            while start < self.size:
                length = min(window, self.size - start)
                self._still_holds(start + length)
                try:
                    mapped = mmap.mmap(self.fd, length, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                       prot=mmap.PROT_READ, offset=start)
                except (OSError, ValueError):
                    if start:
                        raise
                    break  # a file system without memory maps: read it
                self._still_holds(start + length)
                with mapped, memoryview(mapped) as view:
                    for offset in range(0, length, chunk):
                        with view[offset:offset + chunk] as piece:
                            yield piece
                start += length
            if start >= self.size:
                return
        buffer = bytearray(min(chunk, self.size) or 1)
        view = memoryview(buffer)
        while start < self.size:
            n = min(len(buffer), self.size - start)
            self.read_into(view[:n], start)
            yield view[:n]
            start += n

    def _still_holds(self, end: int) -> None:
        """The file still has `end` bytes (it may have been shortened in place since it was checked)."""
        size = os.fstat(self.fd).st_size
        if size < end:
            raise self._short(size)

    def _pread(self, length: int, offset: int) -> bytes:
        try:
            return _pread(self.fd, length, offset)
        except OSError as exc:
            raise self.error(f"{self.path}: cannot be read ({exc.strerror or exc})") from None

    def _short(self, at: int) -> Exception:
        return self.error(f"{self.path}: ends at byte {at}, before its checked size of {self.size} bytes (shortened "
                          "while it was read); allowed: a file nothing changes while it is read")


def open_checked(path: str | os.PathLike, *, error: type[Exception] = OSError, allowed: str = ALLOWED,
                 size: int | None = None, max_bytes: int | None = None,
                 same_as: Identity | None = None) -> CheckedFile:
    """Open `path` without blocking and check the descriptor: a regular file (`allowed` says what the caller
    wants), of `size` bytes where given, at most `max_bytes`, the file `same_as` identifies where given. The caller
    closes it (a `with` block); `error(one line)` otherwise, nothing left open."""
    path = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        link = " (a link to nothing)" if isinstance(exc, FileNotFoundError) and os.path.islink(path) else ""
        raise error(f"{path}: cannot be read ({exc.strerror or exc}){link}") from None
    try:
        info = os.fstat(fd)
        _check(path, info, error, allowed, size, max_bytes, same_as)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return CheckedFile(path, fd, info, error)


def _check(path: Path, info: os.stat_result, error: type[Exception], allowed: str, size: int | None,
           max_bytes: int | None, same_as: Identity | None) -> None:
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _KINDS if test(info.st_mode)), "not a file")
        raise error(f"{path}: not a regular file ({kind}); allowed: {allowed}")
    if same_as is not None and Identity.of(info) != same_as:
        what = ("another file has taken its name" if (info.st_dev, info.st_ino) != (same_as.device, same_as.inode)
                else f"it changed ({info.st_size} bytes, was {same_as.size})")
        raise error(f"{path}: {what} since this load first opened it; allowed: files nothing replaces or changes "
                    "until the load is done")
    if size is not None and info.st_size != size:
        raise error(f"{path}: damaged (size {info.st_size} bytes, expected {size})")
    if max_bytes is not None and info.st_size > max_bytes:
        raise error(f"{path}: {info.st_size} bytes; allowed: {allowed} of at most {max_bytes} bytes")


class CheckedFiles:
    """The files one load opens, each checked at its first open; a later open of the same path must find the same
    file (a swap between two reads of one load is one error line, not a mix of two files)."""

    def __init__(self, error: type[Exception] = OSError, allowed: str = ALLOWED):
        self.error, self.allowed = error, allowed
        self._seen: dict[str, Identity] = {}
        self._lock = threading.Lock()

    def open(self, path: str | os.PathLike, *, size: int | None = None,
             max_bytes: int | None = None) -> CheckedFile:
        key = os.path.abspath(path)
        with self._lock:
            known = self._seen.get(key)
        checked = open_checked(path, error=self.error, allowed=self.allowed, size=size, max_bytes=max_bytes,
                               same_as=known)
        with self._lock:
            self._seen.setdefault(key, checked.identity)
        return checked


_FD_FOLDER: list[str | None] = []


def _fd_folder() -> str | None:
    """Where a process's descriptors have names (Linux: /proc/self/fd, macOS and BSD: /dev/fd); None elsewhere."""
    if not _FD_FOLDER:
        _FD_FOLDER.append(next((f for f in ("/proc/self/fd", "/dev/fd") if os.path.isdir(f)), None))
    return _FD_FOLDER[0]


def _pread(fd: int, length: int, offset: int) -> bytes:
    if hasattr(os, "pread"):
        return os.pread(fd, length, offset)
    os.lseek(fd, offset, os.SEEK_SET)  # Windows: no pread; each CheckedFile is read by one thread at a time
    return os.read(fd, length)


__all__ = ["ALLOWED", "CheckedFile", "CheckedFiles", "Identity", "open_checked"]
