"""Issue 40, "nothing runs that the user did not write": files a loader reads are untrusted.

A planted pickle (a DCP `.metadata`, a `.distcp` item) runs nothing; a JSON value cannot make a loader allocate
more than the file holds; every refusal is one line naming the file (and the key)."""

from __future__ import annotations

import json
import os

import pytest

from accel.core.safe_json import JSONFileError, parse_json, read_json


# -- the JSON reader --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ('{"metadata": {"total_size": ' + "9" * 5000 + "}}",
     "key 'metadata.total_size': an integer of 5000 digits"),
    ('{"a": 1, "a": 2}', "names the key 'a' twice"),
    ('{"a": ' + "[" * 150 + "]" * 150 + "}", "nested more than 100 levels deep"),
    ('{"a": ' + "[" * 100000 + "]" * 100000 + "}", "nested too deeply"),
    ("[1, 2]", "its top level is a JSON array; allowed: a JSON object"),
    ('{"a": ', "not JSON (line 1 column 7"),
])
def test_json_refusals_name_the_file_and_key(tmp_path, text, expected):
    path = tmp_path / "index.json"
    path.write_text(text)
    with pytest.raises(JSONFileError) as info:
        read_json(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and expected in message and "allowed: " in message
    assert "\n" not in message and len(message) < 400


def test_json_file_size_and_kind_are_bounded(tmp_path):
    big = tmp_path / "big.json"
    big.write_text('{"a": "' + "x" * 2000 + '"}')
    with pytest.raises(JSONFileError, match=r"big.json: 2009 bytes; allowed: a JSON file of at most 1000 bytes"):
        read_json(big, max_bytes=1000)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(JSONFileError, match="fifo.json: not a regular file"):  # refused, never blocks
        read_json(fifo)
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(JSONFileError, match=r"bad.json: not UTF-8 \(byte 0xff at offset 7\)"):
        read_json(bad)


def test_json_reads_what_accel_writes(tmp_path):
    value = {"a": [1, 2.5, None, True, "s", {"b": float("inf")}], "n": 2**64}
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(value))
    assert read_json(path) == value
    assert parse_json(b"\xef\xbb\xbf[1]", "x", top=list) == [1]
