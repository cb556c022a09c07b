"""Fault tolerance under repeated SIGKILLs: torchft's replica groups (accel launch --fault_tolerance) against
torchrun's restart-and-reload of the same job (accel launch --max_restarts + save_state/load_state).

    python benchmarks/bench_fault_tolerance.py             # 200 steps, a SIGKILL every 10 s (~2 minutes)
    python benchmarks/bench_fault_tolerance.py --quick     # 80 steps, a SIGKILL every 6 s (a smoke run)

Both jobs run the same loop on 2 CPU processes (gloo): a small MLP, AdamW, and `--step-time` seconds of simulated
compute per step (a sleep, so the figures say what the protocols cost, not what 2 shared cores compute). The driver
SIGKILLs one worker every `--kill-every` seconds while the job runs:

* fault tolerance: 2 replica groups x 1 process, min_replicas 1, `--ft_timeout 15` (torchft's 60 s would let one
  peer killed while the groups set up their process group stall the live group for a minute); the worker of group 1
  is killed, its torchrun restarts it (`--max_restarts 100`) and it heals from group 0, which never restarts;
* restart-and-reload: plain DDP on 2 processes, `--max_restarts 100`, save_state every `--ckpt-every` steps
  (automatic checkpoint naming) and load_state of the latest at every start; rank 1 is killed and torchrun restarts
  both processes.

Each worker appends one JSON line per step (its time, the step count before and after, the participants) to a file
per (group, rank, attempt). From them:

* steps committed: fault tolerance: the steps the live group committed over the steps it ran (a step whose
  all-reduce failed is not committed); restart: the steps that count (the final count) over the steps run, redone
  ones included;
* steps lost per kill: restart: the steps run since the checkpoint that was loaded; fault tolerance: none are lost
  by the live group (it keeps its weights), the killed group's are replaced by the live group's;
* seconds lost per kill: restart: from the kill to the first step past the count reached before it; fault tolerance:
  the live group's longest wait between two commits from the kill until the killed group is back (the lighthouse
  waits `--heartbeat-timeout` seconds before it counts the dead group out), and, for the killed group, the time from
  the kill to its first committed step after healing;
* wall time of the whole job.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------------------
# the worker (this file with --worker, under accel launch)
# ----------------------------------------------------------------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    import torch

    from accel import Accelerator, ProjectConfiguration
    from accel.utils import set_seed

    out = Path(args.out)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    project = ProjectConfiguration(project_dir=str(out / "project"), automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(project_config=project)
    model, optimizer = accelerator.prepare(model, optimizer)
    ft = accelerator.config.fault_tolerance
    group = ft.replica_id if ft.enabled else 0
    rank, attempt = accelerator.process_index, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    (out / f"pid-g{group}-r{rank}").write_text(str(os.getpid()))
    log = open(out / f"steps-g{group}-r{rank}-a{attempt}.jsonl", "a", buffering=1)  # noqa: SIM115

    class Counter:
        def __init__(self) -> None:
            self.step = 0

        def state_dict(self) -> dict:
            return {"step": self.step}

        def load_state_dict(self, state: dict) -> None:
            self.step = int(state["step"])

    counter = Counter()
    if ft.enabled:
        from accel.fault_tolerance import committed_steps

        manager = accelerator.backend.run.manager

        def progress() -> int:
            return committed_steps(accelerator)
    else:
        accelerator.register_for_checkpointing(counter)
        try:
            accelerator.load_state()
        except FileNotFoundError:
            pass  # the first attempt: nothing saved yet

        def progress() -> int:
            return counter.step
    log.write(json.dumps({"t": time.time(), "start": progress()}) + "\n")
    g = torch.Generator().manual_seed(1000 * rank + attempt)
    while progress() < args.steps:
        x = torch.randn(16, 32, generator=g)
        before = progress()
        loss = model(x.to(accelerator.device)).pow(2).mean()
        accelerator.backward(loss)
        time.sleep(args.step_time)  # the step's compute, simulated
        optimizer.step()
        optimizer.zero_grad()
        if ft.enabled:
            record = {"t": time.time(), "before": before, "after": progress(),
                      "participants": manager.num_participants()}
        else:
            counter.step += 1
            record = {"t": time.time(), "before": before, "after": counter.step,
                      "participants": accelerator.num_processes}
            if counter.step % args.ckpt_every == 0:
                accelerator.save_state()
        log.write(json.dumps(record) + "\n")
    accelerator.end_training()


# ----------------------------------------------------------------------------------------------------------------
# the driver
# ----------------------------------------------------------------------------------------------------------------

def run_job(mode: str, out: Path, args: argparse.Namespace) -> dict:
    out.mkdir(parents=True)
    launch = [sys.executable, "-m", "accel.cli.main", "launch", "--cpu", "--num_processes", "2",
              "--max_restarts", "100"]
    if mode == "ft":
        launch += ["--fault_tolerance", "--ft_group_size", "2", "--ft_min_replicas", "1", "--ft_timeout",
                   str(args.ft_timeout), "--ft_heartbeat_timeout", str(args.heartbeat_timeout)]
    victim = out / ("pid-g1-r0" if mode == "ft" else "pid-g0-r1")
    command = [*launch, str(Path(__file__).resolve()), "--worker", "--out", str(out), "--steps", str(args.steps),
               "--step-time", str(args.step_time), "--ckpt-every", str(args.ckpt_every)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ACCEL_CONFIG_FILE", None)
    start = time.time()
    log = open(out / "launch.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    kills: list[float] = []
    try:
        next_kill = start + args.kill_every
        while proc.poll() is None:
            time.sleep(0.1)
            if time.time() >= next_kill and victim.exists():
                try:
                    os.kill(int(victim.read_text()), signal.SIGKILL)
                    kills.append(time.time())
                    victim.unlink()  # the next attempt writes its own
                except (ProcessLookupError, ValueError):
                    pass
                next_kill = time.time() + args.kill_every
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    wall = time.time() - start
    records = {}
    for path in out.glob("steps-g*-r*-a*.jsonl"):
        key = tuple(int(n) for n in re.findall(r"\d+", path.stem))
        records[key] = [json.loads(line) for line in path.read_text().splitlines()]
    return {"mode": mode, "rc": proc.returncode, "wall": wall, "kills": kills, "records": records,
            "healing": (out / "launch.log").read_text().count("healing is required step=0")}


def _steps(records: list) -> list:
    return [r for r in records if "before" in r]


def summarize_ft(job: dict) -> dict:
    live = _steps(job["records"][(0, 0, 0)])
    committed = sum(r["after"] > r["before"] for r in live)
    commits = [r["t"] for r in live if r["after"] > r["before"]]
    stalls, heals = [], []
    for kill in job["kills"]:
        healed = sorted(r["t"] for key, recs in job["records"].items() if key[0] == 1
                        for r in _steps(recs) if r["t"] > kill and r["after"] > r["before"])
        if healed:
            heals.append(healed[0] - kill)
        # the live group's longest wait between two commits from the kill until the killed group is back
        end = healed[0] + 0.5 if healed else kill + 60
        window = [kill] + [t for t in commits if kill < t <= end]
        if len(window) > 1:
            stalls.append(max(b - a for a, b in zip(window[:-1], window[1:], strict=True)))
    restarts_live = len([k for k in job["records"] if k[0] == 0]) - 1
    return {"ran": len(live), "committed": committed, "stalls": stalls, "heals": heals, "restarts_live": restarts_live}


def summarize_restart(job: dict) -> dict:
    attempts = sorted(k for k in job["records"] if k[:2] == (0, 0))
    ran, lost_steps, lost_seconds = 0, [], []
    for i, key in enumerate(attempts):
        steps = _steps(job["records"][key])
        ran += len(steps)
        if i + 1 < len(attempts) and steps:
            reached = steps[-1]["after"]
            nxt = job["records"][attempts[i + 1]]
            resumed = nxt[0]["start"] if nxt and "start" in nxt[0] else 0
            lost_steps.append(reached - resumed)
            kill = min([k for k in job["kills"] if k >= steps[-1]["t"] - 0.5] or [steps[-1]["t"]])  # it ended it
            back = [r["t"] for r in _steps(nxt) if r["after"] > reached]
            if back:
                lost_seconds.append(back[0] - kill)
    return {"ran": ran, "restarts": len(attempts) - 1, "lost_steps": lost_steps, "lost_seconds": lost_seconds}


def _stats(values: list) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} (min {min(values):.1f}, max {max(values):.1f}, n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-time", type=float, default=0.1)
    parser.add_argument("--kill-every", type=float, default=10.0)
    parser.add_argument("--ckpt-every", type=int, default=20)
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0,
                        help="fault_tolerance.heartbeat_timeout: the live group waits this long after a kill")
    parser.add_argument("--ft-timeout", type=float, default=15.0,
                        help="fault_tolerance.timeout: how long an all-reduce or a group's process-group set-up waits "
                             "for a peer that was killed meanwhile (torchft's default is 60)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.steps, args.kill_every = 80, 6.0
    folder = Path(tempfile.mkdtemp(prefix="bench-ft-"))
    ft = run_job("ft", folder / "ft", args)
    rs = run_job("restart", folder / "restart", args)
    f, r = summarize_ft(ft), summarize_restart(rs)
    print(f"# {args.steps} steps of {args.step_time} s, a SIGKILL every {args.kill_every} s, 2 CPU processes; "
          f"restart baseline saves every {args.ckpt_every} steps; heartbeat timeout {args.heartbeat_timeout} s")
    print("| | fault tolerance (torchft, 2 groups x 1) | torchrun restart + load_state (DDP x 2) |")
    print("|---|---|---|")
    print(f"| exit code | {ft['rc']} | {rs['rc']} |")
    print(f"| kills | {len(ft['kills'])} | {len(rs['kills'])} |")
    print(f"| wall time (s) | {ft['wall']:.1f} | {rs['wall']:.1f} |")
    print(f"| restarts of the other processes | {f['restarts_live']} (group 0) | {r['restarts']} (every rank) |")
    print(f"| steps committed / steps run | {f['committed']}/{f['ran']} = {f['committed'] / max(f['ran'], 1):.2f} "
          f"(live group) | {args.steps}/{r['ran']} = {args.steps / max(r['ran'], 1):.2f} |")
    print(f"| steps lost per kill | 0 (live group) | {_stats(r['lost_steps'])} |")
    print(f"| seconds lost per kill | live group's longest wait {_stats(f['stalls'])} | back to the step reached "
          f"{_stats(r['lost_seconds'])} |")
    print(f"| kill -> killed group's first committed step (s) | {_stats(f['heals'])} | (every rank restarts) |")
    print(f"| healings logged | {ft['healing']} | - |")
    print(f"# logs and step records: {folder}")


if __name__ == "__main__":
    main()
