"""Asynchronous save_state on one process: what waits for it, rotation, failures, a kill during the background write,
interpreter exit. (Several processes, DDP / ZeRO-3 / TP: tests/multiproc/checkpoints/test_async_save_multiproc.py.)"""

import errno
import json
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from accel import Accelerator, ProjectConfiguration
from accel.checkpoint import layout
from accel.checkpoint.layout import CheckpointError


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("ACCEL_CONFIG_FILE", "ACCEL_LAUNCH_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def prepared(**kwargs):
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, **kwargs)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def train_step(accelerator, model, optimizer):
    accelerator.backward(model(torch.randn(2, 3, device=accelerator.device)).pow(2).sum())
    optimizer.step()
    optimizer.zero_grad()


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_rotation_waits_for_publication_and_load_state_waits(tmp_path):
    accelerator, model, optimizer = prepared(project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2))
    for _ in range(3):
        train_step(accelerator, model, optimizer)
        accelerator.save_state(async_save=True)  # the next save waits for this one
        saved = weights(model)
    train_step(accelerator, model, optimizer)
    accelerator.load_state()  # waits for the last save, then loads it: the latest complete one
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
    assert accelerator.wait_for_checkpoint() is None  # nothing pending any more


def test_the_config_key_makes_save_state_asynchronous_and_false_overrides_it(tmp_path, monkeypatch):
    accelerator, model, optimizer = prepared()
    accelerator.config.checkpoint_async = "process"  # one process: written in a thread (no process group)
    accelerator.save_state(str(tmp_path / "a"))
    assert accelerator._checkpointer.pending
    assert accelerator.wait_for_checkpoint() == str(tmp_path / "a")
    accelerator.save_state(str(tmp_path / "b"), async_save=False)
    assert not accelerator._checkpointer.pending and (tmp_path / "b" / layout.MANIFEST).is_file()


def test_a_background_failure_is_raised_at_the_next_save_and_the_one_after_works(tmp_path, monkeypatch):
    accelerator, model, optimizer = prepared()
    accelerator.save_state(str(tmp_path / "ckpt"))  # the previous checkpoint
    real = layout.write_manifest

    def full_disk(folder, content):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / layout.MANIFEST))

    monkeypatch.setattr(layout, "write_manifest", full_disk)
    train_step(accelerator, model, optimizer)
    accelerator.save_state(str(tmp_path / "ckpt"), async_save=True)  # returns: the failure comes later
    with pytest.raises(CheckpointError) as failure:
        accelerator.save_state(str(tmp_path / "other"), async_save=True)
    assert str(failure.value) == (f"{tmp_path / 'ckpt'}: could not be saved: No space left on device (writing "
                                  "accel_checkpoint.json); free space on that disk or save elsewhere; nothing was "
                                  "published (a checkpoint already there is unchanged)")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert json.loads((tmp_path / "ckpt" / layout.MANIFEST).read_text())["step"] == 0  # the previous one, intact
    monkeypatch.setattr(layout, "write_manifest", real)
    accelerator.save_state(str(tmp_path / "other"), async_save=True)
    assert accelerator.wait_for_checkpoint() == str(tmp_path / "other")


def test_training_during_the_write_does_not_reach_the_checkpoint(tmp_path, monkeypatch):
    accelerator, model, optimizer = prepared()
    train_step(accelerator, model, optimizer)
    gate, real = threading.Event(), layout.write_manifest

    def held(folder, content):  # the publication waits until training has changed every parameter
        gate.wait(30)
        real(folder, content)

    monkeypatch.setattr(layout, "write_manifest", held)
    accelerator.save_state(str(tmp_path / "ckpt"), async_save=True)
    saved = weights(model)
    saved_state = {k: v.clone() for k, v in optimizer.optimizer.state[next(model.parameters())].items()}
    for _ in range(3):
        train_step(accelerator, model, optimizer)
    gate.set()
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    state = optimizer.optimizer.state[next(model.parameters())]
    assert all(torch.equal(state[k], v) for k, v in saved_state.items())


def slow_staging(monkeypatch, seconds: float = 0.5, fail: bool = False) -> None:
    """Make the background staging copy start `seconds` late (or fail): a step that did not wait for it would
    overwrite the parameters first."""
    from torch.distributed.checkpoint.staging import DefaultStager

    real = DefaultStager.stage

    def late(self, state_dict, **kwargs):
        threading.Event().wait(seconds)
        if fail:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real(self, state_dict, **kwargs)

    monkeypatch.setattr(DefaultStager, "stage", late)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU: pinned staging memory and the copy's own CUDA stream"))])
def test_the_next_steps_wait_for_the_background_copy_and_the_checkpoint_is_the_state_at_the_save(tmp_path,
                                                                                                 monkeypatch, device):
    """save_state(async_save=True) returns before the tensors are copied; the optimizer steps right after it wait for
    the copy, and the forwards (which change batch norm's running statistics, copied at the save) do not need to: the
    checkpoint holds the state of the moment of the save, bit for bit. On a GPU the copy goes to pinned memory on a
    stream of its own, which must first wait for the last step's kernels."""
    from accel.checkpoint import async_save

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=device == "cpu")
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    train_step(accelerator, model, optimizer)
    slow_staging(monkeypatch)
    waited = async_save.staging_waited()
    at_save = weights(model)
    state_at_save = {k: v.clone() for k, v in optimizer.optimizer.state[next(model.parameters())].items()}
    lr_at_save = scheduler.get_last_lr()
    accelerator.save_state(str(tmp_path / "ckpt"), async_save=True)
    assert async_save._STAGING  # it returned with the copy still to do
    for _ in range(3):  # at once: the first step waits for the copy
        train_step(accelerator, model, optimizer)
        scheduler.step()
    assert async_save.staging_waited() - waited > 0.2 and not async_save._STAGING
    assert not all(torch.equal(v, at_save[k]) for k, v in model.state_dict().items())
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert model.state_dict().keys() == at_save.keys()
    assert all(torch.equal(v, at_save[k]) for k, v in model.state_dict().items())  # running_mean/var included
    state = optimizer.optimizer.state[next(model.parameters())]
    assert all(torch.equal(state[k], v) for k, v in state_at_save.items())
    assert scheduler.get_last_lr() == lr_at_save


def test_a_failed_background_copy_is_raised_at_the_next_wait_not_at_the_step(tmp_path, monkeypatch):
    accelerator, model, optimizer = prepared()
    accelerator.save_state(str(tmp_path / "ckpt"))  # the previous checkpoint
    slow_staging(monkeypatch, 0.1, fail=True)
    accelerator.save_state(str(tmp_path / "ckpt"), async_save=True)
    train_step(accelerator, model, optimizer)  # waits for the copy; its failure is the save's, raised at the wait
    with pytest.raises(CheckpointError) as failure:
        accelerator.wait_for_checkpoint()
    assert "\n" not in str(failure.value)
    assert str(failure.value).startswith(f"{tmp_path / 'ckpt'}: could not be saved: ")
    assert "Cannot allocate memory" in str(failure.value)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert json.loads((tmp_path / "ckpt" / layout.MANIFEST).read_text())["step"] == 0  # the previous one, intact


SCRIPT = """
import os, signal, sys, threading, torch
from accel import Accelerator, ProjectConfiguration
from accel.checkpoint import layout
accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=sys.argv[1],
                                                                        automatic_checkpoint_naming=True))
model = accelerator.prepare(torch.nn.Linear(3, 4))
accelerator.save_state()  # checkpoint_0, synchronous
with torch.no_grad():
    model.weight.add_(1)
if sys.argv[2] == "kill":  # SIGKILL while checkpoint_1 is written in the background, before it is published
    reached, real = threading.Event(), layout.write_manifest
    def held(folder, content):
        reached.set()
        threading.Event().wait()
    layout.write_manifest = held
    accelerator.save_state(async_save=True)
    reached.wait(60)
    os.kill(os.getpid(), signal.SIGKILL)
accelerator.save_state(async_save=True)  # "exit": the script ends at once; the interpreter waits for the write
"""


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_a_kill_keeps_the_previous_checkpoint_and_exit_waits(tmp_path, how):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), how], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == (-9 if how == "kill" else 0), proc.stderr
    checkpoints = tmp_path / "run" / "checkpoints"
    latest = layout.latest_checkpoint(checkpoints)
    assert latest.name == ("checkpoint_0" if how == "kill" else "checkpoint_1")
    layout.read_manifest(latest)  # complete, checksums verified
    if how == "kill":  # the killed save is a hidden temporary folder, never taken as a checkpoint
        assert [p.name.startswith(".tmp-checkpoint_1-") for p in checkpoints.iterdir()].count(True) == 1


def test_checkpoint_async_is_validated():
    from accel.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="checkpoint_async.*'sometimes'.*no, thread, process"):
        config_from_dict({"checkpoint_async": "sometimes"})


FAILING = """
import errno, sys, torch
from accel import Accelerator
from accel.checkpoint import layout
out, how = sys.argv[1], sys.argv[2]
accelerator = Accelerator(cpu=True)
model = accelerator.prepare(torch.nn.Linear(3, 4))
accelerator.save_state(out + "/ckpt")  # the previous checkpoint, synchronous
def full_disk(folder, content):
    raise OSError(errno.ENOSPC, "No space left on device", str(folder / layout.MANIFEST))
layout.write_manifest = full_disk
accelerator.save_state(out + "/ckpt", async_save=True)  # fails in the background
if how == "destroy":  # Accelerate's end of a distributed run: waits for the save, then the script goes on
    accelerator.state.destroy_process_group()
    print("the script went on", flush=True)
elif how == "end_training":  # raises the failure into the script
    accelerator.end_training()
elif how == "raise":  # the script fails itself meanwhile: its own exit code stays
    raise RuntimeError("the script's own error")
elif how == "exit3":
    sys.exit(3)
"""


@pytest.mark.parametrize("how", ["exit", "destroy", "end_training", "raise", "exit3"])
def test_a_failed_asynchronous_save_never_exits_0_and_leaves_no_temporary_folder(tmp_path, how):
    """An asynchronous save that fails with no wait left to raise it (the script ended, or Accelerate's
    destroy_process_group waited for it quietly) makes the process exit with async_save.EXIT_CODE (74), after one line
    naming the folder and the cause, also after sys.exit(3) (Python's exit hooks cannot read that code); a failure
    raised into the script (end_training) or a script's uncaught exception is exit code 1. The temporary folder is
    removed every time."""
    from accel.checkpoint.async_save import EXIT_CODE

    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(FAILING))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), how], capture_output=True, text=True,
                          timeout=120)
    expected = {"exit": EXIT_CODE, "destroy": EXIT_CODE, "end_training": 1, "raise": 1, "exit3": EXIT_CODE}[how]
    assert proc.returncode == expected, proc.stderr
    cause = (f"{tmp_path / 'ckpt'}: could not be saved: No space left on device (writing accel_checkpoint.json); "
             "free space on that disk or save elsewhere")
    lines = [line for line in proc.stderr.splitlines() if cause in line]
    assert lines, proc.stderr
    if how in ("exit", "destroy", "exit3"):
        assert lines == [f"accel: error: {cause}; nothing was published (a checkpoint already there is unchanged) "
                         f"(an asynchronous save_state, not waited for by the script); exit code {EXIT_CODE}"]
    if how == "destroy":
        assert "the script went on" in proc.stdout
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")], proc.stderr
    assert json.loads((tmp_path / "ckpt" / layout.MANIFEST).read_text())["step"] == 0  # the previous one, intact
