"""save_state under DDP on 2 processes as Accelerate allows it (scripts/main_process_save.py, one launch per save
mode): called on every process, and on the main process alone (diffusers' example scripts); the save/load pre-hooks
get the user's module (not the DDP wrapper) and save it their own way on the main process only, popping its weights.
A resumed run repeats the losses of the uninterrupted one bit for bit (fp32, dropout on where every process saved:
each rank's RNG states are in the checkpoint). Without the main-process save the main-only case hangs (timeout)."""

import json
import os

import pytest
from _launch import SCRIPTS, accel_launch

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module", params=["sync", "async"])
def reports(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"main_save_{request.param}")
    flags = ["--async_save"] if request.param == "async" else []
    accel_launch(dict(os.environ), "--cpu", "--num_processes", "2", SCRIPTS / "main_process_save.py", "--out", out,
                 *flags, timeout=180)
    return [json.loads((out / f"report_{rank}.json").read_text()) for rank in range(2)]


def test_resume_repeats_the_run(reports):
    for report in reports:
        assert report["wrapped"]
        assert report["resumed_every"] == report["after_every"]
        assert report["resumed_main_only"] == report["after_main_only"]


def test_hooks_get_the_users_module(reports):
    main, other = reports
    assert main["hooks"]["save"] == [["Sequential", True]] * 2  # both saves
    assert other["hooks"]["save"] == [["Sequential", True]]  # the save every process called
    assert main["hooks"]["load"] == other["hooks"]["load"] == [["Sequential", True]] * 2


def test_save_model_and_save_from_the_main_process_alone(reports):
    """Both returned on the main process without the others (else the launch would have hung), and on every process
    a call returns once the main process's files are there."""
    for report in reports:
        assert "model.safetensors" in report["saved_by_every"] and report["saved_by_every"][-1] is True


def test_checkpoint_contents(reports):
    files = reports[0]["files"]
    rng = [f"rng/rank_{r}.{ext}" for r in (0, 1) for ext in ("json", "safetensors")]
    assert set(rng) <= set(files["every"])
    assert "unet/model.safetensors" in files["every"] and "unet/model.safetensors" in files["main_only"]
    assert not any(f.startswith("rng/rank_1") for f in files["main_only"])  # rank 1 did not call save_state
    assert not any(f.startswith("state/") and "model" in f and f.endswith(".json") for f in files["main_only"])


def test_collective_save_called_on_the_main_process_alone_says_so(tmp_path):
    env = {**os.environ, "ACCEL_SAVE_STATE_TIMEOUT": "3"}
    proc = accel_launch(env, "--cpu", "--num_processes", "2", "--zero_stage", "3",
                        SCRIPTS / "collective_save_main_only.py", tmp_path / "ckpt", timeout=120, expect=1)
    assert ("save_state is collective under ZeRO-3 (each process holds part of the state): rank(s) 1 did not call "
            "it within 3 s" in proc.stderr), proc.stderr[-2000:]
    assert not (tmp_path / "ckpt").exists()
