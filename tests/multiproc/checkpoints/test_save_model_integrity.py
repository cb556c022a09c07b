"""save_model in a 2-process DDP job: the folder's files are checksummed, every rank's load_checkpoint_in_model
verifies them, and a damaged shard is the same one-line CheckpointError on both ranks with the model unchanged."""

import json

import pytest
from _launch import SCRIPTS, accel_launch

pytestmark = pytest.mark.multiproc


def test_save_model_checksums_are_verified_on_every_rank(isolated_env, tmp_path):
    script = SCRIPTS / "save_model_integrity.py"
    accel_launch(isolated_env, "--cpu", "--num_processes", 2, script, tmp_path, "save", timeout=180)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"save_{rank}.json").read_text())
        assert report["equal"] and report["keys"] == [[], []], report
    folder = tmp_path / "model"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and sorted(index["metadata"]["accel_checksums"]) == shards
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left

    victim = folder / shards[-1]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x01
    victim.write_bytes(bytes(data))
    accel_launch(isolated_env, "--cpu", "--num_processes", 2, script, tmp_path, "load", timeout=180)
    expected = (f"CheckpointError: {victim}: damaged (its bytes do not match the checksum in "
                "model.safetensors.index.json: corrupted or changed since the save)")
    for rank in (0, 1):
        report = json.loads((tmp_path / f"load_{rank}.json").read_text())
        assert report["error"] == expected and report["unchanged"], report
