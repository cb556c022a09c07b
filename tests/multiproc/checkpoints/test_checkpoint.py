"""save_state / load_state end to end in real processes: bit-exact resume, resharding, and SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm_python
from _launch import accel_launch, launch_jobs
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def run(isolated_env, num_processes: int, script: Path, *args: str, expect: int = 0) -> subprocess.CompletedProcess:
    return accel_launch(isolated_env, "--cpu", "--num_processes", num_processes, script, *args, expect=expect)


def first_runs(out: Path, num_processes: int) -> Path:
    """One launch: the uninterrupted run (out/a), the run stopped mid-epoch after save_state (out/b: 5 or 10 batches
    per epoch, both stop inside epoch 1) and, on 2 processes, one stopped at step 3 (out/c)."""
    stop = 8 if num_processes == 2 else 13
    jobs = [("a", ["--mode", "full"]), ("b", ["--mode", "first", "--stop_step", stop])]
    if num_processes == 2:
        jobs.append(("c", ["--mode", "first", "--stop_step", 3]))
    from conftest import make_isolated_env

    out.mkdir(exist_ok=True)
    launch_jobs(out, make_isolated_env(out), num_processes, SCRIPTS / "resume_train.py", jobs)
    return out


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory) -> Path:
    return first_runs(tmp_path_factory.mktemp("resume_2"), 2)


@pytest.mark.multiproc
@pytest.mark.parametrize("num_processes", [1, 2])
def test_resume_mid_epoch_is_bit_exact(request, isolated_env, tmp_path, num_processes):
    """Stopped mid-epoch after save_state, resumed in fresh processes with load_state + skip_first_batches:
    the final weights equal the uninterrupted run's exactly (max difference 0.0)."""
    out = request.getfixturevalue("two_process_runs") if num_processes == 2 else first_runs(tmp_path / "runs", 1)
    script = SCRIPTS / "resume_train.py"
    checkpoints = sorted(p.name for p in (out / "b" / "checkpoints").iterdir())
    assert checkpoints == ["checkpoint_0", "checkpoint_1"]
    run(isolated_env, num_processes, script, "--out", str(out / "b"), "--mode", "second")

    full = load_file(str(out / "a" / "full.safetensors"))
    resumed = load_file(str(out / "b" / "resumed.safetensors"))
    assert full.keys() == resumed.keys()
    for key in full:
        assert (full[key] - resumed[key]).abs().max().item() == 0.0, key

    # save_model wrote the same weights, sharded in Hugging Face's layout, loadable into a plain model
    from accel import load_checkpoint_in_model

    hf_dir = out / "a" / "hf_model"
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    missing, unexpected = load_checkpoint_in_model(fresh, str(hf_dir), strict=True)
    assert missing == [] and unexpected == []
    assert all(torch.equal(fresh.state_dict()[k], full[k]) for k in full)

    manifest = json.loads((out / "b" / "checkpoints" / "checkpoint_1" / "accel_checkpoint.json").read_text())
    assert manifest["world_size"] == num_processes
    files = list((out / "b" / "checkpoints" / "checkpoint_1").rglob("*"))
    assert {f.suffix for f in files if f.is_file()} <= {".json", ".safetensors"}  # no pickle anywhere


@pytest.mark.multiproc
def test_two_process_checkpoint_loads_on_one_process(two_process_runs, isolated_env):
    """Written under DDP on 2 ranks (the main process writes the replicated state, rank 1 hands over its RNG states:
    one shard file, both ranks' RNG files), loaded by 1: the weights are exactly those saved."""
    script, out = SCRIPTS / "resume_train.py", two_process_runs / "c"
    folder = out / "checkpoints" / "checkpoint_1"
    assert len(list((folder / "state").glob("*.safetensors"))) == 1
    rng = {f"rank_{r}.{ext}" for r in (0, 1) for ext in ("json", "safetensors")}
    assert {p.name for p in (folder / "rng").iterdir()} == rng
    run(isolated_env, 1, script, "--out", str(out), "--mode", "load")
    saved, loaded = load_file(str(out / "at_stop.safetensors")), load_file(str(out / "loaded.safetensors"))
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    run(isolated_env, 1, script, "--out", str(out), "--mode", "second")  # and training goes on from there


@pytest.mark.parametrize("kill_point", ["rng", "manifest"])
def test_sigkill_during_save_state_keeps_the_previous_checkpoint(isolated_env, tmp_path, kill_point):
    proc = warm_python.run([sys.executable, str(SCRIPTS / "killed_save.py"), str(tmp_path), kill_point], cwd=ROOT,
                          env=isolated_env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "killing myself" in proc.stdout and "not reached" not in proc.stdout
    checkpoints = tmp_path / "checkpoints"
    leftovers = [p.name for p in checkpoints.iterdir()]
    assert "checkpoint_0" in leftovers and "checkpoint_1" not in leftovers
    assert any(name.startswith(".tmp-checkpoint_1") for name in leftovers)  # the half-written one, hidden

    from accel.checkpoint.layout import latest_checkpoint, read_manifest

    assert latest_checkpoint(checkpoints).name == "checkpoint_0"
    read_manifest(checkpoints / "checkpoint_0")  # complete and intact
    # the killed owner is gone; make its temporary "old enough" (layout.ABANDONED_AFTER without a write), so the
    # next save may remove it as provably abandoned (a fresh one is kept:
    # tests/unit/checkpoint/test_checkpoint_temporaries.py)
    from accel.checkpoint.layout import ABANDONED_AFTER

    stale = time.time() - ABANDONED_AFTER - 60
    for temporary in checkpoints.glob(".tmp-checkpoint_1*"):
        for path in [temporary, *temporary.rglob("*")]:
            os.utime(path, (stale, stale))
    # a fresh process loads it: the weights are those of checkpoint_0
    check = (
        "import torch, sys\n"
        "from accel import Accelerator, ProjectConfiguration\n"
        "acc = Accelerator(project_config=ProjectConfiguration(project_dir=sys.argv[1], automatic_checkpoint_naming=True))\n"
        "m = torch.nn.Linear(4, 2); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "m, o = acc.prepare(m, o)\n"
        "acc.load_state()\n"
        "assert torch.all(m.weight == 1.0), m.weight\n"
        "acc.save_state()\n"  # the next save removes the abandoned temporary folder and becomes checkpoint_1
        "print('loaded')\n"
    )
    proc = warm_python.run([sys.executable, "-c", check, str(tmp_path)], cwd=ROOT, env=isolated_env,
                          timeout=120)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_0", "checkpoint_1"]


@pytest.mark.multiproc
def test_a_failure_on_one_rank_is_one_line_everywhere(isolated_env, tmp_path):
    """Rank 1's disk fills inside DCP's writer, then while it writes its RNG states (rank 0 never waits for
    it), then only rank 1's RNG file is damaged: both ranks raise the same one line each time, no temporary
    folder is left, the first checkpoint still loads, and the failed load changed nothing. Under ZeRO-3, where
    each rank writes its part (under DDP the main process writes everything: test_main_process_save.py)."""
    accel_launch(isolated_env, "--cpu", "--num_processes", 2, "--zero_stage", 3, SCRIPTS / "failing_save.py",
                 tmp_path, timeout=90)
    reports = [dict(line.split(" ", 1) for line in (tmp_path / f"report_{r}.txt").read_text().splitlines())
               for r in (0, 1)]
    assert reports[0] == reports[1], reports  # the same lines on both ranks
    full = f"{tmp_path / 'ckpt'}: could not be saved on rank 1: No space left on device"
    unchanged = "nothing was published (a checkpoint already there is unchanged)"
    assert reports[0] == {
        "ERR1": f"{full}; free space on that disk or save elsewhere; {unchanged}",
        "ERR2": f"{full} (writing rng/rank_1.safetensors); free space on that disk or save elsewhere; {unchanged}",
        "LOADED": "True",
        # the checksums catch it before anything is parsed, on the rank whose share of the files holds it
        "ERR3": f"{tmp_path / 'ckpt' / 'rng' / 'rank_1.json'}: damaged (its bytes do not match the checksum in "
                "accel_checkpoint.json: corrupted or changed since the save) (rank 0)",
        "END": "unchanged=True leftovers=[] differs_from_saved=True"}
