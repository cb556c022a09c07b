"""`accel merge-weights` on one process: a DCP folder written with `no_dist` (the format of Accelerate's
pytorch_model_fsdp_0) merges exactly; every bad input is one line on stderr with exit code 2. The 2-process ZeRO-3
checkpoints are merged in tests/multiproc/checkpoints/test_merge_weights.py (a different basename: pytest imports both
by name)."""

from __future__ import annotations

import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from accel.checkpoint.merge import MergeError, merge_fsdp_weights
from accel.cli.main import main as accel_main


@pytest.fixture
def merge_cli(capsys):
    """`accel ARGS` in this process (the CLI's own main: parser, one-line errors, exit codes)."""

    def run(*args):
        try:
            code = accel_main([str(arg) for arg in args])
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return run


@pytest.fixture
def dcp_folder(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    folder = tmp_path / "ckpt" / "pytorch_model_fsdp_0"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder), no_dist=True)
    return folder, model.state_dict()


def _one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("accel merge-weights: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


def test_merges_a_dcp_folder_exactly(dcp_folder, tmp_path, run_accel):
    """The installed command, in a subprocess; the other tests call the CLI's main in this process."""
    folder, state = dcp_folder
    proc = run_accel("merge-weights", folder, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert merged.keys() == state.keys() and all(torch.equal(merged[k], v) for k, v in state.items())
    # Accelerate's SHARDED_STATE_DICT folder, merged again over the first result: replaced atomically
    assert merge_fsdp_weights(folder, tmp_path / "out") == tmp_path / "out" / "model.safetensors"


def test_missing_folder_names_it(tmp_path, merge_cli):
    _one_line_error(merge_cli("merge-weights", tmp_path / "nope", tmp_path / "out"), str(tmp_path / "nope"),
                    "not found", "allowed:")


def test_the_parent_of_accelerates_folder_gets_a_hint(dcp_folder, tmp_path, merge_cli):
    folder, _ = dcp_folder
    _one_line_error(merge_cli("merge-weights", folder.parent, tmp_path / "out"), "not a sharded checkpoint",
                    "pass one of those instead", str(folder))


def test_a_file_as_checkpoint_or_as_output(dcp_folder, tmp_path, merge_cli):
    folder, _ = dcp_folder
    file = tmp_path / "weights.txt"
    file.write_text("x")
    _one_line_error(merge_cli("merge-weights", file, tmp_path / "out"), "is a file, not a folder")
    _one_line_error(merge_cli("merge-weights", folder, file), f"output {file} is a file")


def test_damaged_checkpoints(dcp_folder, tmp_path, merge_cli):
    folder, _ = dcp_folder
    (folder / ".metadata").write_bytes(b"not a pickle of metadata")
    _one_line_error(merge_cli("merge-weights", folder, tmp_path / "out"), "cannot read the checkpoint", str(folder))
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "accel_checkpoint.json").write_text("{not json")
    _one_line_error(merge_cli("merge-weights", fake, tmp_path / "out"), "accel_checkpoint.json", "damaged")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_missing_arguments_are_one_line(merge_cli):
    _one_line_error(merge_cli("merge-weights"), "the following arguments are required")


def test_function_raises_a_value_error_and_unsafe_still_writes_safetensors(dcp_folder, tmp_path, capsys):
    folder, state = dcp_folder
    with pytest.raises(MergeError) as exc:
        merge_fsdp_weights(tmp_path / "nope", tmp_path / "out")
    assert isinstance(exc.value, ValueError)
    written = merge_fsdp_weights(folder, tmp_path / "out", safe_serialization=False, remove_checkpoint_dir=True)
    assert written.name == "model.safetensors" and not folder.exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["accel_checksums.json", "model.safetensors"]


def test_a_hand_written_manifest_of_the_wrong_shape_is_one_line_from_python_too(tmp_path):
    """merge_fsdp_weights (the Python API, not only the CLI) refuses a manifest whose shapes save_state never writes
    (one written by hand or another tool, without checksums) with a MergeError naming the key, not a traceback."""
    import json

    from accel import Accelerator

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.save_state(str(tmp_path / "ckpt"))
    manifest_path = tmp_path / "ckpt" / "accel_checkpoint.json"
    manifest = json.loads(manifest_path.read_text())
    for key in ("checksum", "checksums"):
        manifest.pop(key, None)
    manifest["skeleton"]["models"][0] = ["not", "an", "object"]
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(MergeError, match=r"key 'skeleton.models\[0\]': a list, not an object; allowed: the manifest"):
        merge_fsdp_weights(str(tmp_path / "ckpt"), str(tmp_path / "out"))
