"""Fault tolerance without restarts (torchft) under `accel launch --fault_tolerance`, on CPU (gloo).

Two replica groups of 1 process (a tiny transformers Llama, DDP) and of 2 processes (an MLP, ZeRO-3 inside each
group: HSDP, FSDP2 shards in a group and torchft averages the shards over the groups) train an unchanged loop
(scripts/ft_train.py); the last process of the last group SIGKILLs itself after 5 steps committed with both groups
(the Llama's inside its backward, while the live group waits for it in the all-reduce: torchft's own DDP hook then
failed an assertion and crashed the live group; the MLP's between two steps), and its restart waits 3 s before it
starts (a restart that takes a while: torchft's lighthouse lets the live group go on alone once the dead group's
heartbeat is 2 s old, `--ft_heartbeat_timeout 2`, and waits for a restarted group that heartbeats again). The
loop carries everything a real one does besides the weights (`--full-state`): a LambdaLR schedule, dropout,
accumulation over 2 batches, a registered object, and fp16's gradient scaler. Checked:
the live group never restarts and keeps committing (counted, with the steps it committed alone); the killed group is
restarted by its own torchrun and heals from the live group (its first committed step jumps to the others' count:
the whole training state came over the network; the script never saves nor loads a checkpoint); every process
of every group ends with the same weights and the same state besides them (learning rate, scheduler steps, scaler,
`accelerator.step`, the registered object, the torch and Python RNG states: a heal that forgot one leaves the healed
group's different, and with the schedule its weights drift apart); the lighthouse's port is free and no process of
the job is left when accel launch returns.

A second group that starts 15 s late: the first step waits for it, so the job equals plain DDP bit for bit (without
the wait the first group trained alone and the other healed from it). A group whose weights drift from the others'
(one weight changed) is caught by the fingerprint check at the next checked step: every group stops with one line
naming the groups, the step and the tensor, exit code 76, and no group is restarted.

A run without a failure, launched as on two machines (two heads on this host), with min_replicas 2, equals plain DDP
on the same two processes bit for bit; its save_state keeps the Manager's committed steps (load_state restores
them), and the checkpoint loads in plain DDP."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import _launch
import pytest
import torch
import warm_python
from safetensors.torch import load_file

from accel.cli.launch import port_in_use

pytestmark = pytest.mark.multiproc
SCRIPT = _launch.SCRIPTS / "ft_train.py"
STEPS, KILL_AFTER = 60, 5
ACCEL_SCRIPT = "import sys; from accel.cli.main import main; sys.exit(main())"  # what the `accel` script runs


def _launch_marked(env: dict, *args) -> tuple[str, str]:
    """accel launch with a mark in every process's environment; returns (the mark, stderr)."""
    mark = f"accel-ft-test-{uuid.uuid4().hex}"
    proc = _launch.accel_launch({**env, "ACCEL_FT_TEST_MARK": mark}, *args, timeout=240)
    return mark, proc.stderr


def _left_behind(mark: str) -> list[int]:
    """Processes whose environment holds `mark` (none may outlive accel launch)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if mark.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _records(out: Path) -> dict[tuple[int, int, int], list[dict]]:
    """(group, rank, attempt) -> the step records of that process."""
    records = {}
    for path in out.glob("steps-g*-r*-a*.jsonl"):
        group, rank, attempt = map(int, re.findall(r"\d+", path.stem))
        records[(group, rank, attempt)] = [json.loads(line) for line in path.read_text().splitlines()]
    return records


@pytest.mark.parametrize("per_group,model,kill_in,zero_stage,loop", [(1, "llama", "backward", 0, "epochs"),
                                                                     (2, "mlp", "loop", 3, "steps")])
def test_a_killed_group_heals_from_the_live_one(tmp_path, isolated_env, per_group, model, kill_in, zero_stage, loop):
    """`loop="epochs"`: the plain epoch loop, unchanged (one epoch of STEPS batches per process): the healed group's
    loader moves on by the steps it received, so it ends at the others' step (without that it ran STEPS more)."""
    # one epoch is STEPS batches of 4 on each of the 2 x per_group processes
    # (accumulation over 2 batches: an epoch of 2 x STEPS batches is about STEPS optimizer steps, fewer those fp16
    # skipped)
    bound = ["--epochs", 1, "--samples", 2 * STEPS * 4 * 2 * per_group] if loop == "epochs" else ["--steps", STEPS]
    mark, err = _launch_marked(isolated_env, "--cpu", "--num_processes", 2 * per_group, "--zero_stage", zero_stage,
                               "--mixed_precision", "fp16", "--fault_tolerance", "--ft_check_every", 10,
                               "--ft_group_size", 2, "--ft_heartbeat_timeout", 2, "--max_restarts", 2, SCRIPT,
                               "--out", tmp_path, *bound, "--kill-after", KILL_AFTER, "--alone-sleep", 0.5,
                               "--restart-delay", 3, "--model", model, "--kill-in", kill_in, "--full-state")
    records = _records(tmp_path)
    victim_rank = per_group - 1
    # group 0 never restarted; group 1 ran twice (the SIGKILLed attempt, then the restart)
    assert {key for key in records if key[0] == 0} == {(0, r, 0) for r in range(per_group)}, sorted(records)
    assert {key for key in records if key[0] == 1} == {(1, r, a) for r in range(per_group) for a in (0, 1)}
    killed = [r for r in records[(1, victim_rank, 0)] if "killed_at" in r]
    assert len(killed) == 1, records[(1, victim_rank, 0)]
    killed_at, kill_time = killed[0]["killed_at"], killed[0]["t"]
    live = [r for r in records[(0, 0, 0)] if "after" in r]  # its steps (the last line: its state at the end)
    # the epoch loop is bounded by batches, not steps: a step that failed (the victim died in its all-reduce) is not
    # retried, and a group that joined late healed from the first at once (its loader moved on as far)
    final = live[-1]["after"]
    assert final == STEPS if loop == "steps" else STEPS - 8 <= final <= STEPS + 1, final
    alone = [r for r in live if r["t"] > kill_time and r["participants"] == 1 and r["after"] > r["before"]]
    assert alone, "the live group committed no step while the other was down"
    for rank in range(per_group):
        first = records[(1, rank, 1)][0]
        assert first["before"] == 0 and first["after"] > killed_at, first  # healed: the others' count, at once
        # and ended with the live group: at its step, after as many batches (without the loader moving on, the epoch
        # loop of the healed group ran the whole epoch again, the last steps alone)
        assert records[(1, rank, 1)][-2]["after"] == final, records[(1, rank, 1)][-3:]
        # the whole training state, not only the weights: as the live group's same rank holds it at the end
        ended, healed = records[(0, rank, 0)][-1]["state"], records[(1, rank, 1)][-1]["state"]
        assert healed == ended, (healed, ended)
        assert ended["scale"] is not None and ended["registered"] > final and ended["lr"][0] < 1e-2
    assert re.search(r"\[Replica accel_group_1\] healing is required step=0, max_step=\d+, recover_src_replica_rank=0",
                     err), err[-3000:]
    weights = [load_file(str(p)) for p in sorted(tmp_path.glob("weights-g*-r*.safetensors"))]
    assert len(weights) == 2 * per_group
    weights = [w for w in weights if w]  # under ZeRO-3 the gathered weights are on each group's rank 0
    assert len(weights) == (2 if zero_stage else 2 * per_group)
    for other in weights[1:]:
        assert all(torch.equal(weights[0][k], other[k]) for k in weights[0])
    port = int(re.search(r"torchft lighthouse at http://127\.0\.0\.1:(\d+)", err).group(1))
    assert not port_in_use(port, "127.0.0.1")
    assert not _left_behind(mark)
    print(f"per_group={per_group} ({model}): killed at step {killed_at}; the live group committed {len(alone)} "
          f"step(s) alone, {sum(r['after'] > r['before'] for r in live)} in all, never restarting")


def test_without_a_failure_it_equals_plain_ddp_and_checkpoints_keep_the_manager(tmp_path, isolated_env, free_port):
    """Launched as on two machines (this host twice: machine_rank 0 starts the lighthouse on main_process_ip:port and
    group 0, machine_rank 1 starts group 1, which connects to it)."""
    (tmp_path / "ft").mkdir()
    (tmp_path / "ddp").mkdir()
    common = ["--cpu", "--num_processes", 2, "--num_machines", 2, "--main_process_ip", "127.0.0.1", "--fault_tolerance",
              "--ft_group_size", 2, "--ft_min_replicas", 2, "--ft_lighthouse_port", free_port]
    script = [SCRIPT, "--out", tmp_path / "ft", "--steps", 20, "--save"]
    mark = f"accel-ft-test-{uuid.uuid4().hex}"
    second = warm_python.Popen([sys.executable, "-m", "accel.cli.main", "launch", *map(str, common), "--machine_rank",
                               "1", *map(str, script)], cwd=_launch.ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               env={**isolated_env, "OMP_NUM_THREADS": "1", "ACCEL_FT_TEST_MARK": mark})
    try:
        first = _launch.accel_launch({**isolated_env, "ACCEL_FT_TEST_MARK": mark}, *common, "--machine_rank", 0,
                                     *script, timeout=240)
        assert f"torchft lighthouse at http://127.0.0.1:{free_port} (min_replicas 2)" in first.stderr
        out, _ = second.communicate(timeout=120)
        assert second.returncode == 0, out
        assert "torchft lighthouse" not in out  # machine_rank 1 starts none
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    _launch.accel_launch(isolated_env, "--cpu", "--num_processes", 2, SCRIPT, "--out", tmp_path / "ddp",
                         "--steps", 20, "--load-at-end", tmp_path / "ft" / "ckpt-g1")
    ft = _records(tmp_path / "ft")
    steps = {g: [r for r in ft[(g, 0, 0)] if "participants" in r] for g in (0, 1)}
    assert all(r["participants"] == 2 for g in (0, 1) for r in steps[g])  # both groups at every step
    # save_state keeps the Manager's state: zeroed, then load_state gives back the 20 committed steps and the weights
    for g in (0, 1):
        assert ft[(g, 0, 0)][-1] == {"saved_steps": 20, "loaded_steps": 20, "same_weights": True}
    # the checkpoint of a fault-tolerant group loads in plain DDP on 2 processes (a layout of its own)
    saved = load_file(str(tmp_path / "ft" / "weights-g1-r0.safetensors"))
    for rank in (0, 1):
        loaded = load_file(str(tmp_path / "ddp" / f"loaded-g0-r{rank}.safetensors"))
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    ddp = load_file(str(tmp_path / "ddp" / "weights-g0-r0.safetensors"))
    for path in sorted((tmp_path / "ft").glob("weights-g*-r0.safetensors")):
        got = load_file(str(path))
        for key, value in ddp.items():
            torch.testing.assert_close(got[key], value, atol=2e-6, rtol=1e-5, msg=f"{path.name} {key}")
    initial = _launch.worker_module("ft_train").make_problem()[2].state_dict()
    assert not all(torch.allclose(initial[k], ddp[k]) for k in ddp)  # it trained
    assert not _left_behind(mark)


def _diloco_reference(steps: int, sync_every: int, outer_lr: float) -> dict:
    """Two replica groups of one process, in one process: each runs AdamW on its own batches (group r: batches r,
    r+2, ...); every `sync_every` steps the pseudo-gradients (last synchronised weights - local weights) are averaged,
    the weights go back to the synchronised ones and an outer SGD (Nesterov, momentum 0.9) steps with the average."""
    import copy

    x, y, model = _launch.worker_module("ft_train").make_problem("mlp")
    models = [model, copy.deepcopy(model)]
    inner = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    synced = copy.deepcopy(model)
    outer = torch.optim.SGD(synced.parameters(), lr=outer_lr, momentum=0.9, nesterov=True)
    for step in range(1, steps + 1):
        for rank, (m, opt) in enumerate(zip(models, inner, strict=True)):
            batch = slice((2 * (step - 1) + rank) * 4, (2 * (step - 1) + rank + 1) * 4)
            torch.nn.functional.mse_loss(m(x[batch]), y[batch]).backward()
            opt.step()
            opt.zero_grad()
        if step % sync_every == 0:
            with torch.no_grad():
                for p, a, b in zip(synced.parameters(), models[0].parameters(), models[1].parameters(), strict=True):
                    p.grad = ((p - a) + (p - b)) / 2
            outer.step()
            outer.zero_grad()
            with torch.no_grad():
                for m in models:
                    for target, source in zip(m.parameters(), synced.parameters(), strict=True):
                        target.copy_(source)
    return {k: v.detach() for k, v in models[0].state_dict().items()}


def test_diloco_over_replica_groups(tmp_path, isolated_env):
    """fault_tolerance.semi_sync_method diloco (torchft's DiLoCo, every 3 steps), with Accelerate's LocalSGD block in
    the script (which then only counts): both groups end with the weights of an in-process DiLoCo reference."""
    mark, _ = _launch_marked(isolated_env, "--cpu", "--num_processes", 2, "--fault_tolerance", "--ft_group_size", 2,
                             "--ft_min_replicas", 2, "--ft_semi_sync_method", "diloco", "--ft_sync_steps", 3, SCRIPT,
                             "--out", tmp_path, "--steps", 18, "--local-sgd-steps", 3)
    records = _records(tmp_path)
    assert [r["synced"] for r in records[(0, 0, 0)] if "synced" in r][-1] == 6  # 6 synchronisations committed
    expected = _diloco_reference(18, 3, 0.7)
    for group in (0, 1):
        got = load_file(str(tmp_path / f"weights-g{group}-r0.safetensors"))
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-5, msg=f"group {group} {key}")
    assert not _left_behind(mark)


def test_a_late_group_is_waited_for_and_diverged_groups_are_stopped(tmp_path, isolated_env):
    """Group 1 starts 15 s late: the first step waits for it (fault_tolerance.start_timeout), and the job, a loop with
    a schedule, dropout, accumulation and a registered object, ends bit-equal to plain DDP on the same 2 processes
    (without the wait the first group trained alone and the other healed from it: different steps, different
    weights). Then a job whose group 1 changes one weight after 7 steps is stopped at the check of step 10 with one
    line, exit code 76, neither group restarted (--max_restarts 2)."""
    for name in ("late", "ddp", "diverged"):
        (tmp_path / name).mkdir()
    steps = 12
    _, err = _launch_marked(isolated_env, "--cpu", "--num_processes", 2, "--fault_tolerance", "--ft_group_size", 2,
                            SCRIPT, "--out", tmp_path / "late", "--steps", steps, "--full-state", "--start-delay", 15)
    assert "not come within" not in err
    # plain DDP counts batches: 2 per optimizer step
    _launch.accel_launch(isolated_env, "--cpu", "--num_processes", 2, SCRIPT, "--out", tmp_path / "ddp", "--steps",
                         2 * steps, "--full-state")
    late = _records(tmp_path / "late")
    assert all(r["participants"] == 2 for r in late[(0, 0, 0)] if "participants" in r)  # together from step 1
    ddp = load_file(str(tmp_path / "ddp" / "weights-g0-r0.safetensors"))
    for group in (0, 1):
        got = load_file(str(tmp_path / "late" / f"weights-g{group}-r0.safetensors"))
        assert all(torch.equal(got[k], ddp[k]) for k in ddp), group
        assert late[(group, 0, 0)][-1] == _records(tmp_path / "ddp")[(0, 0, 0)][-1]  # the state besides the weights

    proc = _launch.accel_launch(isolated_env, "--cpu", "--num_processes", 2, "--fault_tolerance", "--ft_group_size",
                                2, "--ft_check_every", 5, "--max_restarts", 2, SCRIPT, "--out", tmp_path / "diverged",
                                "--steps", 30, "--diverge-at", 7, expect=76)
    lines = [line for line in proc.stderr.splitlines() if "hold different weights" in line]
    assert len(lines) == 2, proc.stderr[-3000:]  # one per group, the same
    assert re.fullmatch(r"accel: error: fault tolerance: the replica groups hold different weights after committed "
                        r"step 10: 0\.weight \(fingerprint group 0: \d+, group 1: \d+\); stopped rather than trained "
                        r"on .*checked every 5 steps, fault_tolerance\.check_every\)", lines[0]), lines[0]
    assert "restarting the worker group" not in proc.stderr
    diverged = _records(tmp_path / "diverged")
    assert set(diverged) == {(0, 0, 0), (1, 0, 0)}  # no attempt 1
    assert all(r["after"] <= 10 for rs in diverged.values() for r in rs)  # stopped at the check, not trained on


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_head_ends_the_job_as_without_fault_tolerance(tmp_path, isolated_env, signum):
    """Ctrl-C (SIGINT) exits 130 and SIGTERM to a loop that never asks `preemption_requested` 143, as without fault
    tolerance, with one line from the head: not each group's own 'stopped by signal' nor 'ended with exit code ...
    (after its restarts)' for groups the head stopped itself (Ctrl-C gave 143 and three lines). The head runs as
    the `accel` script does (`accel.cli.main:main`, the module imported, not `__main__`), and its forked groups'
    launchers say nothing of it (runpy warned once that the module was imported already)."""
    mark = f"accel-ft-test-{uuid.uuid4().hex}"
    proc = warm_python.Popen([sys.executable, "-c", ACCEL_SCRIPT, "launch", "--cpu", "--num_processes", "2",
                             "--fault_tolerance", "--ft_group_size", "2", str(SCRIPT), "--out", str(tmp_path),
                             "--steps", "100000"], cwd=_launch.ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True,
                             env={**isolated_env, "OMP_NUM_THREADS": "1", "ACCEL_FT_TEST_MARK": mark})
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"steps-g{g}-r0-a0.jsonl").exists() and
                      (tmp_path / f"steps-g{g}-r0-a0.jsonl").stat().st_size for g in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signum, err[-3000:]
    name = signal.Signals(signum).name
    # a process the signal ended may leave half a log line on the shared stderr: the head's line can follow it
    ours = [line[line.index("accel launch: "):] for line in err.splitlines() if "accel launch: " in line
            and ("signal" in line or "after its restarts" in line)]
    assert ours == [f"accel launch: stopped by signal {int(signum)} ({name}); every replica group was stopped"], \
        err[-3000:]
    assert "RuntimeWarning" not in err, err[-3000:]
    assert not _left_behind(mark)


def test_a_group_later_than_the_start_timeout_is_left_behind_in_one_line(tmp_path, isolated_env):
    """`--ft_start_timeout 2` and group 1 eight seconds late: group 0 says in one line that it starts without
    group 1, and trains alone; group 1 heals from it when it comes and both end with the same weights. The groups'
    launchers and workers are fresh interpreters here (`ACCEL_FRESH_WORKERS=1`, as on GPUs); elsewhere forked."""
    mark, err = _launch_marked({**isolated_env, "ACCEL_FRESH_WORKERS": "1"}, "--cpu", "--num_processes", 2,
                               "--fault_tolerance", "--ft_group_size", 2, "--ft_start_timeout", 2, SCRIPT, "--out",
                               tmp_path, "--steps", 40, "--start-delay", 8, "--alone-sleep", 0.2)
    said = [line for line in err.splitlines() if "not come within" in line]
    assert said == ["accel: fault tolerance: replica group(s) 1 not come within fault_tolerance.start_timeout (2 s); "
                    "the others start without them (they heal from them when they come)"], err[-3000:]
    records = _records(tmp_path)
    assert records[(0, 0, 0)][0]["participants"] == 1  # group 0 began alone
    assert records[(1, 0, 0)][0]["after"] > 1  # group 1 healed: it began at the others' step
    first, second = (load_file(str(tmp_path / f"weights-g{g}-r0.safetensors")) for g in (0, 1))
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not _left_behind(mark)


def test_a_taken_lighthouse_port_is_refused_in_one_line_and_no_group_is_left(tmp_path, isolated_env):
    """The head forks its groups' launchers before it starts the lighthouse (its runtime's threads must not be
    forked): when the port is taken they have not started a worker, and they end with the head's one line."""
    import socket

    mark = f"accel-ft-test-{uuid.uuid4().hex}"
    (out := tmp_path / "out").mkdir()
    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _launch.accel_launch({**isolated_env, "ACCEL_FT_TEST_MARK": mark}, "--cpu", "--num_processes", 2,
                                    "--fault_tolerance", "--ft_group_size", 2, "--ft_lighthouse_port", port, SCRIPT,
                                    "--out", out, expect=2)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"accel launch: error: fault_tolerance: torchft's lighthouse could not bind [::]:{port}: "
                      f"Address already in use (os error 98); allowed: a free --ft_lighthouse_port"], proc.stderr
    assert not list(out.iterdir())  # no worker started
    assert not _left_behind(mark)
