"""The CRC-32 checkpoints are verified with: isal's where installed, zlib's otherwise, the same values either way."""

from __future__ import annotations

import os
import sys
import types
import zlib

import pytest

from accel.checkpoint import layout


@pytest.fixture
def fresh_choice():
    layout._crc32_function.cache_clear()
    yield
    layout._crc32_function.cache_clear()


def test_crc32_gives_zlibs_values_whole_and_continued():
    data = os.urandom(3 << 20) + b"tail"
    assert layout.crc32(data) == zlib.crc32(data)
    continued = layout.crc32(memoryview(data)[1000:], layout.crc32(data[:1000]))
    assert continued == zlib.crc32(data)
    assert layout.crc32(b"") == 0 and layout.crc32(b"", 12345) == 12345


def test_a_file_checksum_matches_zlib_over_the_same_bytes(tmp_path):
    data = os.urandom(layout.CHUNK + 12345)  # more than one chunk
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    expected = f"crc32:{zlib.crc32(data):08x}"
    assert layout.file_checksum(path) == expected
    assert layout.verify_file_checksum(path, expected)
    assert not layout.verify_file_checksum(path, f"crc32:{zlib.crc32(data) ^ 1:08x}")


def test_without_isal_it_is_zlibs(fresh_choice, monkeypatch):
    monkeypatch.setitem(sys.modules, "isal", None)
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)
    assert layout._crc32_function() is zlib.crc32


def test_an_isal_giving_wrong_values_is_not_used(fresh_choice, monkeypatch):
    broken = types.ModuleType("isal.isal_zlib")
    broken.crc32 = lambda data, value=0: 0  # type: ignore[attr-defined]
    package = types.ModuleType("isal")
    package.isal_zlib = broken  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "isal", package)
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", broken)
    assert layout._crc32_function() is zlib.crc32


def test_isal_is_used_where_installed(fresh_choice):
    isal_zlib = pytest.importorskip("isal.isal_zlib")
    assert layout._crc32_function() is isal_zlib.crc32
