"""Read back what experiment trackers wrote (shared by the unit and multi-process tracking tests)."""

import json
import struct
from pathlib import Path


def wandb_history(run_file: str) -> tuple[list[dict], dict]:
    """The logged rows and config of an offline wandb run, from its .wandb file (a LevelDB-style log of protobuf
    records: 7-byte file header, 32 KiB blocks, records with a 7-byte header crc/length/type)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, part, rows, config = Path(run_file).read_bytes(), 7, b"", [], {}
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
            elif record.WhichOneof("record_type") == "config":
                config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == 0 and length == 0:
            break
    return rows, config
