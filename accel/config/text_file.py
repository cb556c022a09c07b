"""Reading a text file accel is given (a config file, a DeepSpeed JSON, a hostfile, an env file) with every way it can
be unreadable as one ConfigError naming it: missing, a folder, no permission, a path the OS refuses, not UTF-8.
A UTF-8 BOM (what some Windows editors write) is dropped, so it never becomes part of the first key or host name."""

from __future__ import annotations

from pathlib import Path

from accel.config.errors import ConfigError


def read_text(path: Path, what: str, allowed: str) -> str:
    """The UTF-8 text of `path` (a UTF-8 BOM is dropped); ConfigError naming the file when it is missing, a folder,
    unreadable or not UTF-8. `what` names the file in messages ("config file"), `allowed` is what it should be."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory; allowed: {allowed}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the {what}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a NUL byte in the path
        raise ConfigError(f"{path!r}: cannot read the {what}: {exc}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                          f"allowed: {allowed} saved as UTF-8") from None
