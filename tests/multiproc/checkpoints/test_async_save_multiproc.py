"""Asynchronous save_state on 2 real processes (gloo): under DDP, ZeRO-3 and TP 2 the background-written checkpoint
holds exactly the state at the save, although save_state returned before the tensors were copied and training went on
at once (the next step waited for the copy) and while it was written (its tensors equal a synchronous
save's of the same moment, bit for bit, and load_state brings the step-3 weights back); torch's checkpoint process
(`checkpoint_async: process`) does the same; a failure in the background is one line on every rank at the wait.
Also on 2 processes under DDP and ZeRO-3: a flipped bit in a state file and an AdamW checkpoint loaded into SGD are
one-line CheckpointErrors on every rank with the weights unchanged. All jobs share one launch."""

import json
from pathlib import Path

import pytest
import torch
from _launch import SCRIPTS, launch_jobs
from safetensors.torch import load_file

JOBS = {"ddp": [], "ddp_process": ["--mode", "process"], "zero3": ["--zero_stage", 3], "tp2": ["--tp_size", 2],
        "fail": ["--fail"],
        # checkpoint integrity on 2 processes: a flipped bit, another optimizer type
        "ddp_integrity": ["--integrity"], "zero3_integrity": ["--integrity", "--zero_stage", 3],
        "ddp_sgd": ["--optimizer", "sgd", "--load_from", "{root}/ddp_integrity/ckpt"],
        "zero3_sgd": ["--optimizer", "sgd", "--zero_stage", 3, "--load_from", "{root}/zero3_integrity/ckpt"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import make_isolated_env

    out = tmp_path_factory.mktemp("async_save")
    stdout = launch_jobs(out, make_isolated_env(out), 2, SCRIPTS / "async_save_train.py", list(JOBS.items()))
    return out, stdout


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor piece in a checkpoint's state/ files, by file and name."""
    return {f"{f.name}:{k}": v for f in sorted((folder / "state").glob("*.safetensors"))
            for k, v in load_file(str(f)).items()}


@pytest.mark.multiproc
@pytest.mark.parametrize("job", ["ddp", "ddp_process", "zero3", "tp2"])
def test_async_checkpoint_is_the_state_at_the_save(runs, job):
    out = runs[0] / job
    records = [json.loads((out / f"record_{r}.json").read_text()) for r in range(2)]
    assert all(r["published"] == str(out / "async") and r["second_wait"] is None for r in records)
    # save_state returned with the copy of the tensors still in progress, and the next step waited for it (under DDP
    # the main process saves alone: only it copies)
    stagers = records[:1] if job.startswith("ddp") else records
    assert all(r["staging_in_progress"] and r["staging_waited_s"] > 0.2 for r in stagers), records
    sync, background = _tensors(out / "sync"), _tensors(out / "async")
    assert sync.keys() == background.keys() and sync
    assert all(torch.equal(sync[k], background[k]) for k in sync), job  # bit for bit, though training went on
    at_save, loaded = load_file(str(out / "at_save.safetensors")), load_file(str(out / "loaded.safetensors"))
    assert at_save.keys() == loaded.keys()
    assert all(torch.equal(at_save[k], loaded[k]) for k in at_save)
    manifest = json.loads((out / "async" / "accel_checkpoint.json").read_text())
    assert set(manifest["checksums"]) == set(manifest["files"])  # checksummed like a synchronous save
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.multiproc
def test_a_background_failure_is_one_line_on_every_rank(runs):
    out = runs[0] / "fail"
    errors = [json.loads((out / f"record_{r}.json").read_text())["error"] for r in range(2)]
    assert errors[0] == errors[1] and errors[0] is not None
    assert "\n" not in errors[0]
    assert errors[0].startswith(f"{out / 'async'}: could not be saved on rank 0: No space left on device")
    assert not (out / "async").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]  # the temporary folder was removed


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["ddp", "zero3"])
def test_changed_bytes_and_another_optimizer_are_refused_on_every_rank(runs, backend):
    out = runs[0]
    checks = [json.loads((out / f"{backend}_integrity" / f"record_{r}.json").read_text()) for r in range(2)]
    assert checks[0] == checks[1]
    check = checks[0]
    assert check["flipped_bit"].startswith(f"{check['victim']}: damaged (its bytes do not match the checksum in "
                                           "accel_checkpoint.json")
    assert check["flipped_bit_unchanged"] and check["restored_loads"]
    other = [json.loads((out / f"{backend}_sgd" / f"record_{r}.json").read_text()) for r in range(2)]
    assert other[0] == other[1]
    assert other[0]["other_optimizer"] == (
        f"{out / f'{backend}_integrity' / 'ckpt' / 'accel_checkpoint.json'}: optimizer 0 was saved from a "
        "torch.optim.adamw.AdamW, the prepared one is a torch.optim.sgd.SGD; prepare the optimizer type the checkpoint "
        "was saved with")
    assert other[0]["other_optimizer_unchanged"]


UNGUARDED = """
import sys, torch
from accel import Accelerator, ParallelismConfig
accelerator = Accelerator(parallelism_config=ParallelismConfig(zero_stage=3))
accelerator.config.checkpoint_async = "process"
model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer = accelerator.prepare(model, optimizer)
accelerator.save_state(sys.argv[1])
sys.stdout.write(f"published {accelerator.wait_for_checkpoint()}\\n")  # one write: two ranks share stdout
sys.stdout.flush()
"""


@pytest.mark.multiproc
def test_the_checkpoint_process_does_not_run_an_unguarded_script_again(isolated_env, tmp_path):
    """torch's checkpoint process is spawned, and spawn runs the parent's __main__ again: a script without an
    `if __name__ == "__main__":` guard trained again in it and joined the process group, and the job hung."""
    from _launch import accel_launch

    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    proc = accel_launch(isolated_env, "--cpu", "--num_processes", 2, script, tmp_path / "ckpt", timeout=90)
    assert proc.stdout.count(f"published {tmp_path / 'ckpt'}") == 2, proc.stdout
    assert (tmp_path / "ckpt" / "accel_checkpoint.json").is_file()
