"""`accel launch` under fault tolerance (the config's `fault_tolerance` section, `--fault_tolerance`): torchft's
lighthouse and one `accel launch` per replica group.

On each machine the launcher (the "head") runs `group_size / num_machines` replica groups, each a launcher of its
own (`accel launch --num_processes num_processes/group_size --num_machines 1`, torchrun's agent inside, with its own
`--max_restarts`), in a session of its own, with a config file that names the group's `replica_id` (machine_rank x
groups per machine + i) and the lighthouse's address. With `lighthouse: start` the head of machine_rank 0 runs
torchft's `LighthouseServer` in its own process: on one machine on a free port of 127.0.0.1, across machines on
`main_process_ip:lighthouse_port` (29510 unless given). On CPU each group's launcher is forked from the head,
which imports torch once, as workers are forked from their launcher (forked_workers.py); on GPUs (and with
`ACCEL_FRESH_WORKERS=1`) it is a fresh interpreter. Under SLURM: `srun --ntasks-per-node=1 accel launch
--fault_tolerance ...` (one head per node; SLURM gives each its machine_rank), or a `--hostfile` launch.

A group whose workers fail is restarted by its own agent (`--max_restarts`), and heals from a live group; the other
groups keep training. A group that exhausts its restarts ends; the others go on. The head returns when every group
has ended: 0 when all ended well, else the exit code of the first group to fail (each failed group named in one
line). SIGTERM/SIGINT to the head are passed to every group's launcher (its workers are asked to save and stop, as
without fault tolerance); when the head returns, every group's session is ended and the lighthouse is shut down.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from accel.cli import config_flags, forked_workers
from accel.cli._common import UsageError
from accel.config import AccelConfig
from accel.config.schema import DEFAULT_LIGHTHOUSE_PORT

GROUP_ENV = "ACCEL_FT_REPLICA_ID"  # each group's workers (and launcher) see their replica id here too
STOP_GRACE_S = 15.0  # after SIGTERM to a group's launcher, what is left of its session gets SIGKILL
JOIN_TIMEOUT_MS = 10_000  # the lighthouse waits this long for heartbeating groups to join a quorum
QUORUM_TICK_MS = 100


def add_flags(parser: argparse.ArgumentParser) -> None:
    """`accel launch`'s fault-tolerance flags, one per key of the `fault_tolerance` config section, generated from its
    field specs (config_flags.py)."""
    group = parser.add_argument_group("fault tolerance (torchft: replica groups that heal from a live peer)")
    config_flags.add(group, *config_flags.section_keys("fault_tolerance"))


def runs_groups(cfg: AccelConfig) -> bool:
    """Whether this launcher starts the replica groups (fault tolerance on, and no replica_id: not a group itself)."""
    return cfg.fault_tolerance.enabled and cfg.fault_tolerance.replica_id is None


def groups_here(cfg: AccelConfig) -> list[int]:
    """The replica ids of the groups this machine runs."""
    per_machine = cfg.fault_tolerance.group_size // cfg.num_machines
    return list(range(cfg.machine_rank * per_machine, (cfg.machine_rank + 1) * per_machine))


def lighthouse_bind(cfg: AccelConfig) -> tuple[str, str]:
    """(bind, the address groups connect to, without the port when it is chosen at bind time)."""
    ft = cfg.fault_tolerance
    if cfg.num_machines == 1:
        port = ft.lighthouse_port or 0
        return f"[::]:{port}", "127.0.0.1"
    port = ft.lighthouse_port or DEFAULT_LIGHTHOUSE_PORT
    return f"[::]:{port}", f"{cfg.main_process_ip}:{port}"


def group_config(cfg: AccelConfig, replica_id: int, lighthouse: str) -> AccelConfig:
    """What one group's launcher runs: its share of the processes on this machine, its replica id, the lighthouse."""
    ft = dataclasses.replace(cfg.fault_tolerance, replica_id=replica_id, lighthouse=lighthouse)
    return dataclasses.replace(cfg, num_processes=cfg.num_processes // cfg.fault_tolerance.group_size, num_machines=1,
                               machine_rank=0, main_process_ip=None, main_process_port=None, distributed_type=None,
                               fault_tolerance=ft)


def group_command(args: argparse.Namespace, config_path: Path, processes: int, script_argv: list[str]) -> list[str]:
    """`accel launch` for one group. Its flags beat anything a cluster's environment says (srun's node rank)."""
    command = [sys.executable, "-m", "accel.cli.main", "launch", "--config_file", str(config_path),
               "--num_processes", str(processes), "--num_machines", "1", "--machine_rank", "0",
               "--max_restarts", str(args.max_restarts)]
    if args.accelerate_shim:
        command.append("--accelerate_shim")
    if getattr(args, "no_python", False):
        command.append("--no_python")
    return [*command, *script_argv]


def run_groups(args: argparse.Namespace, cfg: AccelConfig, script_argv: list[str]) -> int:
    """Start the lighthouse (when asked, on machine_rank 0) and this machine's groups; wait for them all."""
    ft = cfg.fault_tolerance
    bind, where = lighthouse_bind(cfg)
    start = ft.lighthouse == "start"
    if args.dry_run:
        lighthouse = f"{where}:<port>" if start and cfg.num_machines == 1 else (where if start else ft.lighthouse)
        lines = ["# accel launch --dry_run (fault tolerance): nothing was started"]
        if start and cfg.machine_rank == 0:
            lines.append(f"# torchft lighthouse in this launcher: bind {bind}, min_replicas {ft.min_replicas}")
        processes = cfg.num_processes // ft.group_size
        for replica in groups_here(cfg):
            lines.append(f"# replica group {replica}: {processes} process(es), lighthouse {lighthouse}")
            lines.append(f"{GROUP_ENV}={replica} " + shlex.join(group_command(args, Path("<group config>"), processes,
                                                                                script_argv)))
        sys.stdout.write("\n".join(lines) + "\n")
        return 0
    fork = forked_workers.wanted(on_cpu=cfg.resolved_distributed_type() != "MULTI_GPU")
    if fork:
        forked_workers.preload()  # imported once here, not once per group
    folder = Path(tempfile.mkdtemp(prefix="accel-ft-"))
    groups: dict[int, subprocess.Popen | forked_workers.ForkedProcess] = {}
    commands: dict[int, int] = {}  # replica -> the pipe its forked launcher reads its command from
    stopping: list[int] = []
    server = None

    def stop(signum, _frame) -> None:
        stopping.append(signum)
        for proc in groups.values():  # the same signal: each group's launcher does what it does without groups
            with contextlib.suppress(ProcessLookupError):  # (SIGTERM: its workers save and stop; SIGINT: stop)
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if fork:  # forked before the lighthouse starts: its runtime's threads and state are not to be forked
            for replica in groups_here(cfg):
                groups[replica], commands[replica] = _fork_group({**os.environ, GROUP_ENV: str(replica)},
                                                                 list(commands.values()))
        server, lighthouse = _start_lighthouse(cfg)
        for replica in groups_here(cfg):
            sub = group_config(cfg, replica, lighthouse)
            command = group_command(args, sub.save(folder / f"group{replica}.yaml"), sub.num_processes, script_argv)
            if fork:  # a group that a signal ended meanwhile has no reader: `_wait` says how the job ended
                with contextlib.suppress(BrokenPipeError), os.fdopen(commands.pop(replica), "wb") as pipe:
                    pipe.write(json.dumps(command).encode())
            else:
                groups[replica] = subprocess.Popen(command, start_new_session=True,
                                                   env={**os.environ, GROUP_ENV: str(replica)})
        return _wait(groups, stopping)
    finally:
        for fd in commands.values():  # groups never told their command (the lighthouse failed): they exit at once
            os.close(fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _end_groups(groups)
        if server is not None:
            server.shutdown()
        for path in folder.glob("*"):
            path.unlink()
        folder.rmdir()


def _start_lighthouse(cfg: AccelConfig):
    """(torchft's LighthouseServer when this launcher runs it, else None; the address groups connect to)."""
    ft = cfg.fault_tolerance
    if ft.lighthouse != "start":
        return None, ft.lighthouse
    bind, where = lighthouse_bind(cfg)
    if cfg.machine_rank != 0:
        return None, where
    from torchft._torchft import LighthouseServer

    try:
        server = LighthouseServer(bind=bind, min_replicas=ft.min_replicas, join_timeout_ms=JOIN_TIMEOUT_MS,
                                  quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=int(ft.heartbeat_timeout * 1000))
    except Exception as exc:  # noqa: BLE001 - the port is taken, or the address cannot be bound
        raise UsageError(f"fault_tolerance: torchft's lighthouse could not bind {bind}: "
                         f"{' '.join(str(exc).split())}; allowed: a free --ft_lighthouse_port") from None
    port = server.address().rsplit(":", 1)[1].strip("/")
    lighthouse = f"{where}:{port}" if cfg.num_machines == 1 else where
    sys.stderr.write(f"accel launch: torchft lighthouse at http://{lighthouse} (min_replicas {ft.min_replicas})\n")
    return server, lighthouse


def _fork_group(env: dict[str, str], other_pipes: list[int]) -> tuple[forked_workers.ForkedProcess, int]:
    """A group's launcher forked from this one (as workers are: forked_workers.py): it waits for its command on a
    pipe, then runs it as `accel launch` would (an empty pipe: it exits, the head says why). Returns (the process,
    the pipe's write end)."""
    read, write = os.pipe()

    def run() -> int:
        for fd in (write, *other_pipes):  # the head's ends: the pipes end when the head closes them
            os.close(fd)
        with os.fdopen(read, "rb") as pipe:
            data = pipe.read()
        if not data:
            return 1
        import runpy

        command = json.loads(data)  # `python -m accel.cli.main launch ...`, run here as python would run it
        sys.argv = [command[2], *command[3:]]
        sys.modules.pop(command[2], None)  # as under `python -m`: only `__main__` (the `accel` script imported it)
        runpy.run_module(command[2], run_name="__main__", alter_sys=True)
        return 0

    proc = forked_workers.fork_session(run, env, ("accel", "launch", "(replica group)"))
    os.close(read)
    return proc, write


def _wait(groups: dict, stopping: list[int]) -> int:
    """Wait for every group; the first failure's exit code (0 when every group ended well). A group that failed on
    its own is named in one line; after a signal to this launcher, one line says how the job ended, and its code is
    what the same signal gives without fault tolerance (130 for SIGINT; 75 when every group saved at a preemption
    request, else 143 for SIGTERM)."""
    failed: list[tuple[int, int]] = []
    ended_by_signal: list[int] = []
    running = dict(groups)
    while running:
        for replica, proc in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            del running[replica]
            if code != 0 and stopping:
                ended_by_signal.append(code)
            elif code != 0:
                failed.append((replica, code))
                sys.stderr.write(f"accel launch: replica group {replica} ended with exit code {code} (after its "
                                 f"restarts); {len(running)} other group(s) still running\n")
        time.sleep(0.2)
    if failed:
        return failed[0][1]
    return _stopped(stopping[0], ended_by_signal) if stopping else 0


def _stopped(signum: int, codes: list[int]) -> int:
    """The line and exit code of a job this launcher was asked to stop (the groups' launchers say nothing)."""
    from accel.runtime.preemption import EXIT_CODE as PREEMPTED

    if codes and all(code == PREEMPTED for code in codes):
        sys.stderr.write(f"accel launch: the workers of every replica group stopped at the preemption request; exit "
                         f"code {PREEMPTED} (run the same command again to resume)\n")
        return PREEMPTED
    if not codes:  # every group had ended well by the time the signal came
        return 0
    sys.stderr.write(f"accel launch: stopped by signal {signum} ({signal.Signals(signum).name}); every replica "
                     "group was stopped\n")
    return 128 + signum


def _end_groups(groups: dict) -> None:
    """Every group's session ends with the head: SIGTERM to what is left, SIGKILL after STOP_GRACE_S."""
    alive = [proc for proc in groups.values() if proc.poll() is None]
    for proc in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in alive:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in alive:  # still not reaped (so its pid, the session's id, is not reused): SIGKILL the session
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
