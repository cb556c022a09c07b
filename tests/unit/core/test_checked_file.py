"""accel.core.checked_file: a file is opened once without blocking, checked on its descriptor (a regular file, of
the declared size), read only through that descriptor and only inside its checked size; a later open in the same
load must find the same file. Each refusal is one line naming the file, the bad value and what is allowed."""

from __future__ import annotations

import os
import re
import zlib

import pytest
from file_swaps import finishes, replace

from accel.core.checked_file import CheckedFiles, open_checked
from accel.core.safe_json import JSONFileError, read_json


class Refused(ValueError):
    pass


def test_a_regular_file_is_read_through_its_descriptor_even_after_its_name_changes(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(200)))
    with open_checked(path, error=Refused, size=200) as checked:
        replace(path, "fifo")  # the name now holds a FIFO: the descriptor still holds the file checked
        assert checked.read(10, 5) == bytes(range(10, 15))
        with open(checked.name, "rb") as again:  # the descriptor's own name opens the checked file, not the FIFO
            assert again.read() == bytes(range(200))
        buffer = bytearray(4)
        checked.read_into(buffer, 196)
        assert buffer == bytes(range(196, 200))
        assert zlib.crc32(b"".join(bytes(c) for c in checked.chunks(64, 128))) == zlib.crc32(bytes(range(200)))


@pytest.mark.parametrize("kind, says", [("fifo", "not a regular file (a FIFO)"),
                                        ("device", "not a regular file (a character device)")])
def test_a_pipe_or_device_is_refused_without_blocking(tmp_path, kind, says):
    path = tmp_path / "data.bin"
    path.write_bytes(b"x")
    replace(path, kind)
    with pytest.raises(Refused, match=f"^{re.escape(f'{path}: {says}; allowed: a regular file')}$"):
        finishes(lambda: open_checked(path, error=Refused), tmp_path)
    with pytest.raises(Refused, match="not a regular file \\(a folder\\)"):
        open_checked(tmp_path, error=Refused)


def test_sizes_and_reads_are_bounded(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(16))
    with pytest.raises(Refused, match=f"^{path}: damaged \\(size 16 bytes, expected 32\\)$"):
        open_checked(path, error=Refused, size=32)
    with pytest.raises(Refused, match="16 bytes; allowed: a regular file of at most 8 bytes"):
        open_checked(path, error=Refused, max_bytes=8)
    with open_checked(path, error=Refused) as checked:
        with pytest.raises(Refused, match="bytes 8-24 lie past its end \\(16 bytes\\)"):
            checked.read(8, 16)
        os.truncate(path, 4)  # shortened while it is read: an error, never a short result
        with pytest.raises(Refused, match="ends at byte 4, before its checked size of 16 bytes"):
            checked.read()
        with pytest.raises(Refused, match="ends at byte 4"):
            list(checked.chunks(8, 8))
    with pytest.raises(Refused, match=f"^{tmp_path / 'missing'}: cannot be read \\(No such file or directory\\)$"):
        open_checked(tmp_path / "missing", error=Refused)


def test_a_file_opened_again_in_the_same_load_must_be_the_same_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(16))
    opened = CheckedFiles(Refused)
    opened.open(path).close()
    opened.open(path).close()  # the same file: fine
    replace(path, "short")
    with pytest.raises(Refused, match=f"^{path}: another file has taken its name since this load first opened it"):
        opened.open(path)
    other = tmp_path / "other.bin"
    other.write_bytes(bytes(16))
    opened.open(other).close()
    with open(other, "ab") as f:
        f.write(b"more")
    with pytest.raises(Refused, match="it changed \\(20 bytes, was 16\\)"):
        opened.open(other)


def test_safe_json_reads_through_the_checked_descriptor(tmp_path):
    path = tmp_path / "index.json"
    path.write_text('{"a": 1}')
    assert read_json(path) == {"a": 1}
    replace(path, "device")
    with pytest.raises(JSONFileError, match="index.json: not a regular file \\(a character device\\); allowed: a "
                                            "JSON file"):
        finishes(lambda: read_json(path), tmp_path)
