"""`accel merge-weights` / `merge_fsdp_weights` on real 2-process ZeRO-3 (FSDP2) checkpoints: accel's save_state
and a DCP folder of the sharded state dict (Accelerate's SHARDED_STATE_DICT shape), both written by one launch
(scripts/merge_worker.py). The merged file must equal the gathered full state dict bit for bit (tolerance 0) and load
strictly into a fresh model."""

import json
import shutil
import sys

import pytest
import torch
import warm_python
from _launch import SCRIPTS, accel_launch, worker_module
from conftest import make_isolated_env
from safetensors.torch import load_file

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    env = make_isolated_env(root)
    accel_launch(env, "--cpu", "--num_processes", 2, SCRIPTS / "merge_worker.py", root / "out", timeout=300)
    return root / "out", env


def _merge_cli(env, *args):
    return warm_python.run([sys.executable, "-m", "accel.cli.main", "merge-weights", *map(str, args)], env=env,
                          timeout=120)


def _assert_equal_to_full(out, merged_file):
    full = load_file(out / "full.safetensors")
    merged = load_file(merged_file)
    assert sorted(merged) == sorted(full)
    for name, tensor in full.items():
        assert merged[name].dtype == tensor.dtype and torch.equal(merged[name], tensor), name
    model = worker_module("merge_worker").TinyLM()
    model.load_state_dict(merged, strict=True)  # every name, tied ones too
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, full[name]), name


def test_the_launch_saved_sharded_state(saved):
    out, _ = saved
    record = json.loads((out / "record.json").read_text())
    assert record["dtensor"] == "DTensor"  # the state dict really was sharded over the 2 ranks
    assert sorted(p.name for p in (out / "pytorch_model_fsdp_0").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_cli_merges_accel_save_state(saved, tmp_path):
    out, env = saved
    proc = _merge_cli(env, out / "ckpt", tmp_path / "merged")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"merged 6 tensors into {tmp_path / 'merged' / 'model.safetensors'}"
    _assert_equal_to_full(out, tmp_path / "merged" / "model.safetensors")


def test_function_merges_a_dcp_distcp_folder(saved, tmp_path):
    from accel.utils import merge_fsdp_weights

    out, _ = saved
    written = merge_fsdp_weights(out / "pytorch_model_fsdp_0", tmp_path / "merged")
    assert written == tmp_path / "merged" / "model.safetensors"
    _assert_equal_to_full(out, written)


def test_unsafe_serialization_still_writes_safetensors_and_remove_checkpoint_dir(saved, tmp_path):
    out, env = saved
    copy = tmp_path / "pytorch_model_fsdp_0"
    shutil.copytree(out / "pytorch_model_fsdp_0", copy)
    proc = _merge_cli(env, copy, tmp_path / "merged", "--unsafe_serialization", "--remove_checkpoint_dir")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("never writes pickle files") == 1
    assert sorted(p.name for p in (tmp_path / "merged").iterdir()) == ["accel_checksums.json", "model.safetensors"]
    assert not copy.exists()
    _assert_equal_to_full(out, tmp_path / "merged" / "model.safetensors")
