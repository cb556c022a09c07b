"""`accel launch` on clusters: DeepSpeed-style hostfiles started over ssh, and SLURM job steps.

Hostfile (`accel launch --hostfile FILE ...`), DeepSpeed's format::

    # comments and blank lines are fine
    worker-0 slots=4
    worker-1 slots=4

The launcher on this machine (the "head") picks the hosts and slots (`--include`/`--exclude` in DeepSpeed's
`host1:0,1@host2` syntax, then `--num_machines` takes the first N hosts and `--num_processes`, the total as
everywhere in accel, the first num_processes/num_machines slots of each), then starts ONE `accel launch` per
host over ssh (`--ssh_command`, else `$ACCEL_SSH_COMMAND`, else `ssh -o BatchMode=yes`), each with its
machine_rank (the host's position), num_machines, num_processes, main_process_ip (the first host unless
given) and port. Slots are GPU ids on that host: a subset other than the first N becomes that host's
`--gpu_ids`. Every host must have the same Python environment, script and config file at the same paths
(a shared filesystem, as DeepSpeed and Accelerate assume); the remote command `cd`s to this directory.

The remote launchers get these variables of this environment (names starting with one of
`FORWARDED_ENV_PREFIXES`, as DeepSpeed forwards PYTHON*/NCCL*/...), plus the `KEY=VALUE` lines of
`~/.accel_env` and `./.accel_env` (DeepSpeed's `.deepspeed_env`; the file name can be changed with
`$ACCEL_ENV_FILE`). They are written on the remote command line, so keep secrets out of them.

When one host's launcher exits non-zero, the head stops the others (it closes their stdin: a launcher
started by the head stops its workers when its ssh connection goes away; then SIGTERM, then SIGKILL to the
ssh clients), names the host that failed first and exits with its code.

SLURM (`srun --ntasks-per-node=1 accel launch ...` in a job step of several nodes): machine_rank,
num_machines and main_process_ip come from SLURM_PROCID (SLURM_NODEID), SLURM_STEP_NUM_NODES (SLURM_NNODES)
and the first host of SLURM_STEP_NODELIST (SLURM_NODELIST, SLURM_JOB_NODELIST; the list is never expanded
whole), unless given as flags; they beat the config file's values (a file cannot know which node it is read
on). SLURM's, Kubeflow's PET_* and MPI's machine counts and ranks must agree (one line naming both otherwise).
The variables are read by accel.runtime.cluster_env, as under plain python.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel.cli._common import DEFAULT_MULTI_MACHINE_PORT, UsageError, add_flag
from accel.config.errors import shown
from accel.config.schema import MAX_PROCESSES_PER_MACHINE
from accel.config.text_file import read_text
# the one reading of each scheduler's variables, shared with plain python
from accel.runtime.cluster_env import ClusterEnvError, check_machines, read_mpi, read_slurm

SSH_COMMAND_ENV = "ACCEL_SSH_COMMAND"
DEFAULT_SSH_COMMAND = "ssh -o BatchMode=yes"
ENV_FILE_ENV = "ACCEL_ENV_FILE"
DEFAULT_ENV_FILE = ".accel_env"
# set on the remote command line: that launcher stops its workers when its stdin (the ssh channel) closes
HEAD_WATCH_ENV = "ACCEL_STOP_WHEN_STDIN_CLOSES"
FORWARDED_ENV_PREFIXES = ("PYTHON", "ACCEL_", "ACCELERATE_", "NCCL_", "GLOO_", "TORCH_", "OMP_", "MKL_",
                          "MLFLOW_", "UCX_", "MV2_", "FI_")
NOT_FORWARDED_ENV = {"ACCEL_LAUNCH_CONFIG", "ACCEL_CONFIG_FILE", SSH_COMMAND_ENV, ENV_FILE_ENV, HEAD_WATCH_ENV,
                     "ACCEL_RESTART_COUNT"}
# launch flags the head sets per host itself (everything else the user gave is passed on unchanged)
HEAD_ONLY_DESTS = {"hostfile", "include", "exclude", "ssh_command", "num_machines", "num_processes",
                   "machine_rank", "main_process_ip", "main_process_port", "config_file", "module", "script",
                   "script_args", "help", "dry_run"}
STOP_GRACE_S = 15.0


def add_flags(parser: argparse.ArgumentParser) -> None:
    """`accel launch`'s cluster flags."""
    group = parser.add_argument_group("clusters (hostfile over ssh; under SLURM see `srun accel launch`)")
    add_flag(group, "hostfile", metavar="FILE", default=None,
             help="DeepSpeed-style hostfile ('HOST slots=N' lines): start one launcher per host over ssh")
    add_flag(group, "include", metavar="SPEC", default=None,
             help="hosts/slots to use, DeepSpeed's syntax: 'host1:0,1@host2' (all slots of host2)")
    add_flag(group, "exclude", metavar="SPEC", default=None, help="hosts/slots to leave out, same syntax")
    add_flag(group, "ssh_command", metavar="CMD", default=None,
             help=f"how to reach a host (default: ${SSH_COMMAND_ENV}, else '{DEFAULT_SSH_COMMAND}')")


# -------------------------------------------------------------------------------------------------------
# hostfile, --include/--exclude, --num_machines/--num_processes
# -------------------------------------------------------------------------------------------------------

_SLOTS = re.compile(r"slots=([0-9]+)")
MAX_SLOTS = MAX_PROCESSES_PER_MACHINE  # processes (GPUs) on one host
# a host name or address as ssh and torchrun take it; not starting with "-" (ssh would read an option)
_HOST = re.compile(r"(?!-)[\w.:\[\]%-]{1,253}")


def parse_hostfile(text: str, path: str) -> dict[str, int]:
    """host -> slots, in file order. Blank lines and `#` comments are skipped; any other line that is not
    `HOST slots=N` (N >= 1), or a host listed twice, is a one-line error naming `path:line`."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"hostfile {path}:{number}"
        fields = line.split()
        match = _SLOTS.fullmatch(fields[1]) if len(fields) == 2 else None
        if match is None:
            raise UsageError(f"{where}: {shown(line)} is not a host line; allowed: 'HOST slots=N', e.g. 'worker-0 "
                             "slots=4'")
        host, slots = fields[0], int(match.group(1)[:12])
        if not 1 <= slots <= MAX_SLOTS:
            given = match.group(1) if len(match.group(1)) <= 20 else match.group(1)[:20] + "..."
            raise UsageError(f"{where}: host {shown(host)} has slots={given}; allowed: slots=1 or more (at most "
                             f"{MAX_SLOTS})")
        if "@" in host or "," in host:
            raise UsageError(f"{where}: host name {host!r} contains '@' or ','; allowed: a host name or address")
        if not _HOST.fullmatch(host):
            raise UsageError(f"{where}: host name {shown(host)} is not a host name or address; allowed: letters, "
                             "digits and . _ - : (not starting with -), e.g. 'worker-0 slots=4'")
        if host in hosts:
            raise UsageError(f"{where}: host {host!r} is listed twice; allowed: one line per host")
        hosts[host] = slots
    if not hosts:
        raise UsageError(f"hostfile {path}: no hosts in it; allowed: lines like 'worker-0 slots=4'")
    return hosts


def read_hostfile(path: str) -> dict[str, int]:
    try:
        data = Path(path).read_bytes()
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise UsageError(f"--hostfile {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        text = data.decode("utf-8-sig")  # a BOM must not become part of the first host name
    except UnicodeDecodeError as exc:
        raise UsageError(f"--hostfile {path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                         "allowed: a hostfile of 'HOST slots=N' lines saved as UTF-8") from None
    return parse_hostfile(text, path)


def parse_node_specs(spec: str, flag: str, pool: dict[str, int]) -> dict[str, list[int] | None]:
    """DeepSpeed's `NAME[:SLOT[,SLOT...]][@NAME...]` -> host -> sorted slots (None: all of its slots).
    A host of the hostfile is matched whole first, so an address with ':' in it works without slots."""
    chosen: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        part = part.strip()
        if not part:
            raise UsageError(f"{flag} {spec!r}: empty host between '@'; allowed: 'host1:0,1@host2'")
        host, slots = part, None
        if part not in pool and ":" in part:
            host, slot_text = part.rsplit(":", 1)
            try:
                slots = sorted({int(s) for s in slot_text.split(",")})
            except ValueError:
                raise UsageError(f"{flag} {spec!r}: bad slot list {slot_text!r} for host {host!r}; allowed: "
                                 f"comma-separated slot numbers, e.g. {host}:0,1") from None
        if host not in pool:
            raise UsageError(f"{flag} {spec!r}: host {host!r} is not in the hostfile; hosts there: "
                             f"{', '.join(pool)}")
        for slot in slots or ():
            if not 0 <= slot < pool[host]:
                raise UsageError(f"{flag} {spec!r}: host {host!r} has no slot {slot}; it has slots={pool[host]} "
                                 f"(0 to {pool[host] - 1})")
        if slots is None or (host in chosen and chosen[host] is None):
            chosen[host] = None  # all of its slots
        else:
            chosen[host] = sorted(set(chosen.get(host) or []) | set(slots))
    return chosen


def filter_hosts(pool: dict[str, int], include: str | None, exclude: str | None) -> dict[str, list[int]]:
    """host -> slots to use, in hostfile order, after `--include` or `--exclude` (not both, as in DeepSpeed)."""
    if include and exclude:
        raise UsageError("--include and --exclude exclude each other; give one of them")
    hosts = {host: list(range(slots)) for host, slots in pool.items()}
    if include:
        picked = parse_node_specs(include, "--include", pool)
        hosts = {host: slots if (chosen := picked[host]) is None else chosen
                 for host, slots in hosts.items() if host in picked}
    elif exclude:
        dropped = parse_node_specs(exclude, "--exclude", pool)
        for host, slots in dropped.items():
            hosts[host] = [] if slots is None else [s for s in hosts[host] if s not in slots]
        hosts = {host: slots for host, slots in hosts.items() if slots}
    if not hosts:
        raise UsageError(f"--exclude {exclude!r} leaves no host to run on")
    return hosts


@dataclass(frozen=True)
class Machine:
    """One host of the job: its machine_rank is its position in the plan."""

    host: str
    slots: tuple[int, ...]

    @property
    def gpu_ids(self) -> str | None:
        """`--gpu_ids` for this host when its slots are not simply the first N."""
        return None if self.slots == tuple(range(len(self.slots))) else ",".join(map(str, self.slots))


def plan_machines(pool: dict[str, int], include: str | None = None, exclude: str | None = None,
                  num_machines: int | None = None, num_processes: int | None = None) -> list[Machine]:
    """The hosts and slots to run on: `--include`/`--exclude`, then the first `num_machines` hosts, then the
    first `num_processes / num_machines` slots of each (accel runs as many processes on every machine)."""
    hosts = filter_hosts(pool, include, exclude)
    if num_machines is not None:
        if not 1 <= num_machines <= len(hosts):
            raise UsageError(f"--num_machines {num_machines}: the hostfile offers {len(hosts)} host(s) "
                             f"({', '.join(hosts)}); allowed: 1 to {len(hosts)}")
        hosts = dict(list(hosts.items())[:num_machines])
    if num_processes is not None:
        per_host, rest = divmod(num_processes, len(hosts))
        most = len(hosts) * min(map(len, hosts.values()))
        if num_processes < 1 or rest:
            raise UsageError(f"--num_processes {num_processes} is not a positive multiple of the {len(hosts)} "
                             f"machine(s); allowed: the total over all machines, e.g. {most}")
        short = {host: len(slots) for host, slots in hosts.items() if len(slots) < per_host}
        if short:
            raise UsageError(f"--num_processes {num_processes} means {per_host} per machine but "
                             + ", ".join(f"{h} has {n} slot(s)" for h, n in short.items())
                             + f"; allowed: at most {most}")
        hosts = {host: slots[:per_host] for host, slots in hosts.items()}
    counts = {len(slots) for slots in hosts.values()}
    if len(counts) > 1:
        raise UsageError("the chosen hosts have different numbers of slots ("
                         + ", ".join(f"{h}: {len(s)}" for h, s in hosts.items())
                         + "); accel runs as many processes on every machine: give --num_processes (the total) "
                           "or --include to pick equal slots")
    return [Machine(host, tuple(slots)) for host, slots in hosts.items()]


# -------------------------------------------------------------------------------------------------------
# SLURM
# -------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _one_line() -> Iterator[None]:
    """A scheduler's variable that accel cannot take (accel.runtime.cluster_env's one line) as accel launch's error."""
    try:
        yield
    except ClusterEnvError as exc:
        raise UsageError(str(exc)) from None


def slurm_overrides(env: Mapping[str, str], given: dict) -> dict:
    """machine_rank/num_machines/main_process_ip for a SLURM job step of several nodes, minus the keys in
    `given` (the flags the user gave). Empty outside `srun`, or on one node. First, every scheduler's machine count
    and rank against every other's (SLURM, Kubeflow's PET_*, MPI): one line when two disagree."""
    with _one_line():
        check_machines(env, given)
        step = read_slurm(env)
    if step is None or step.nodes is None:
        return {}  # not in a job step: a batch script or salloc shell runs on one node only
    nodes, tasks = step.nodes, step.tasks
    if nodes[1] <= 1:
        if tasks is not None and tasks[1] > 1 and given.get("machine_rank") is None:  # N launchers: N separate jobs
            raise UsageError(f"SLURM started {tasks[1]} tasks on one node (${tasks[0]}); accel launch must run once "
                             "per node: srun --ntasks-per-node=1 accel launch ... (it starts the processes itself)")
        return {}
    wanted = {key for key in ("num_machines", "machine_rank", "main_process_ip") if given.get(key) is None}
    if not wanted:
        return {}
    if tasks is not None and tasks[1] != nodes[1]:
        raise UsageError(f"SLURM started {tasks[1]} tasks on {nodes[1]} nodes (${tasks[0]}); accel launch must run "
                         "once per node: srun --ntasks-per-node=1 accel launch ... (it starts the processes itself)")
    found: dict[str, Any] = {"num_machines": nodes[1]}
    rank = step.procid or step.nodeid
    if rank is not None:
        found["machine_rank"] = rank[1]
    if "main_process_ip" in wanted:
        with _one_line():
            host = step.main_host(env, "give --main_process_ip")  # the first host only: never the whole list
        if host is not None:
            found["main_process_ip"] = host
    missing = wanted - set(found)
    if missing:
        raise UsageError(f"in a SLURM job step of {nodes[1]} nodes but {', '.join(sorted(missing))} could not be "
                         f"read from SLURM's variables; give --{' --'.join(sorted(missing))}")
    return {key: found[key] for key in wanted}


def refuse_mpi_launchers(env: Mapping[str, str], given: dict) -> None:
    """`mpirun -np N accel launch ...` (N > 1): every launcher would start a job of its own. Refused in one line,
    unless its machine rank is given (one launcher per machine, as with a hostfile or `srun`)."""
    if given.get("machine_rank") is not None:
        return
    with _one_line():
        worlds = read_mpi(env)
    for world in worlds:
        if world.size > 1:
            raise UsageError(f"{world.family}'s mpirun started {world.size} processes (${world.size_var}) and each "
                             "accel launch would start a job of its own: run `mpirun -np N python train.py` "
                             "(Accelerator() forms one group from MPI's variables), or one accel launch per machine "
                             "with --machine_rank")


# -------------------------------------------------------------------------------------------------------
# the remote commands
# -------------------------------------------------------------------------------------------------------

def read_env_file(path: str) -> dict[str, str]:
    """`KEY=VALUE` lines (blank lines and `#` comments skipped); a bad line, a NUL byte (no environment can hold it)
    or a file that is not UTF-8 text is a one-line error."""
    found = {}
    text = read_text(Path(path), "env file", "an env file of KEY=VALUE lines")
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise UsageError(f"{path}:{number}: {shown(line)} is not a variable; allowed: KEY=VALUE")
        if "\x00" in value:
            raise UsageError(f"{path}:{number}: the value of {key} holds a NUL byte; allowed: text without NUL bytes")
        found[key] = value.strip()
    return found


MAX_ARG_BYTES = 128 * 1024 - 1  # Linux's MAX_ARG_STRLEN: the longest one argument (the remote command) may be


def environ_file_name(environ: Mapping[str, str] = os.environ) -> str:
    """The env files' name: $ACCEL_ENV_FILE, else (unset or empty) `.accel_env`."""
    return environ.get(ENV_FILE_ENV) or DEFAULT_ENV_FILE


def forwarded_env(environ: dict, cwd: str, home: str) -> dict[str, str]:
    """What the remote launchers get from here: the variables with a forwarded prefix, then the env files
    (`~/.accel_env`, then `./.accel_env`, later ones winning)."""
    env = {key: value for key, value in environ.items()
           if key.startswith(FORWARDED_ENV_PREFIXES) and key not in NOT_FORWARDED_ENV}
    name = environ_file_name(environ)
    for folder in dict.fromkeys((home, cwd)):
        path = os.path.join(folder, name)
        if os.path.isdir(path):  # not silently skipped as a missing file is
            raise UsageError(f"{path}: is a folder; allowed: a file of KEY=VALUE lines (or none)")
        if os.path.isfile(path):
            env.update(read_env_file(path))
    return env


def passed_on_flags(args: argparse.Namespace, launch_parser: argparse.ArgumentParser) -> list[str]:
    """The launch flags the user gave, as argv for the remote launchers (all but the ones the head sets
    per host), read from `accel launch`'s parser so that every flag it has is passed on."""
    argv: list[str] = []
    for action in launch_parser._actions:
        if not action.option_strings or action.dest in HEAD_ONLY_DESTS:
            continue
        value = getattr(args, action.dest, None)
        if value is None or value is False or value == action.default:
            continue
        option = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
        if action.nargs == 0:
            argv.append(option)
        elif isinstance(value, (list, tuple)):
            argv += [option, *map(str, value)]
        else:
            argv += [option, str(value)]
    return argv


def remote_command(machine_argv: list[str], env: dict[str, str], cwd: str, python: str = sys.executable) -> str:
    """The shell command one host runs: cd here, set the forwarded variables, run `accel launch`."""
    assignments = [shlex.quote(f"{key}={value}") for key, value in {**env, HEAD_WATCH_ENV: "1"}.items()]
    launch = [python, "-u", "-m", "accel.cli.main", "launch", *machine_argv]
    return f"cd {shlex.quote(cwd)} && exec env {' '.join(assignments)} {shlex.join(launch)}"


def machine_argv(machines: list[Machine], rank: int, port: int, main_ip: str, shared: list[str],
                 config_file: str | None, script_argv: list[str]) -> list[str]:
    """The `accel launch` arguments for the host with this machine_rank."""
    machine = machines[rank]
    argv = list(shared)
    if config_file:
        argv += ["--config_file", config_file]
    argv += ["--num_machines", str(len(machines)), "--num_processes", str(len(machines) * len(machine.slots)),
             "--machine_rank", str(rank), "--main_process_ip", main_ip, "--main_process_port", str(port)]
    if machine.gpu_ids is not None:
        argv += ["--gpu_ids", machine.gpu_ids]
    if script_argv[0] == "-m":
        return argv + ["--module", *script_argv[1:]]
    return argv + script_argv


def ssh_command(args: argparse.Namespace, environ: Mapping[str, str]) -> list[str]:
    text = args.ssh_command or environ.get(SSH_COMMAND_ENV) or DEFAULT_SSH_COMMAND
    try:
        command = shlex.split(text)
    except ValueError as exc:
        raise UsageError(f"--ssh_command {text!r}: {exc}; allowed: a command line such as 'ssh -p 2222'") from None
    if not command:
        raise UsageError("--ssh_command is empty; allowed: a command line such as 'ssh -o BatchMode=yes'")
    return command


# -------------------------------------------------------------------------------------------------------
# running the hosts
# -------------------------------------------------------------------------------------------------------

def _describe_exit(code: int) -> str:
    if code < 0:  # the ssh client itself (the host's launcher's own signal comes back as 128 + N)
        try:
            name = f" ({signal.Signals(-code).name})"
        except ValueError:
            name = ""
        return f"was killed by signal {-code}{name} (its ssh client, on this machine)"
    if code == 255:
        return "exited with code 255 (ssh could not reach it, or the connection dropped)"
    return f"exited with code {code}"


def _stop(procs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """Stop the hosts still running: close their stdin first (a launcher started by the head stops its
    workers when that channel closes), then SIGTERM and finally SIGKILL the ssh clients."""
    for proc in procs:
        if proc.poll() is None and proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(sig)
        deadline = time.monotonic() + (grace_s if sig is None else 5.0)
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
        if all(p.poll() is not None for p in procs):
            return


def run_hosts(machines: list[Machine], commands: list[list[str]], poll_s: float = 0.1) -> int:
    """Start one command per host, wait for all; the first one to fail stops the others (named, exit code)."""
    procs: list[subprocess.Popen] = []
    try:
        for command in commands:
            procs.append(subprocess.Popen(command, stdin=subprocess.PIPE))
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [(i, code) for i, code in enumerate(codes) if code is not None and code != 0]
            if failed:
                rank, code = failed[0]
                others = [i for i, c in enumerate(codes) if c is None]
                _stop(procs)
                stopped = (f"; stopped {', '.join(machines[i].host for i in others)}" if others
                           else "")
                sys.stdout.flush()
                sys.stderr.write(f"accel launch: host {machines[rank].host} (machine_rank {rank}) failed first: it "
                                 f"{_describe_exit(code)}{stopped}\n")
                return code if code > 0 else 128 - code
            if all(code == 0 for code in codes):
                return 0
            time.sleep(poll_s)
    finally:
        _stop(procs)


def run_on_hosts(args: argparse.Namespace, script_argv: list[str], resolve,
                 launch_parser: argparse.ArgumentParser) -> int:
    """`accel launch --hostfile FILE ...`: plan the machines, check the config once here, start one
    `accel launch` per host. `resolve(overrides)` resolves the config with extra overrides (for the check);
    the flags passed on are those of `launch_parser` the user gave."""
    from accel.config.resolve import user_config_path

    if args.machine_rank is not None:
        raise UsageError("--machine_rank cannot be given with --hostfile: each host's rank is its position in "
                         "the hostfile")
    machines = plan_machines(read_hostfile(args.hostfile), args.include, args.exclude, args.num_machines,
                             args.num_processes)
    if args.gpu_ids is not None and any(m.gpu_ids is not None for m in machines):
        raise UsageError("--gpu_ids and slot lists in --include/--exclude both choose GPUs; give one of them")
    main_ip = args.main_process_ip or machines[0].host
    per_host = len(machines[0].slots)
    cfg = resolve({"num_machines": len(machines), "num_processes": len(machines) * per_host, "machine_rank": 0,
                   "main_process_ip": main_ip})  # a bad config fails here, once, not on every host
    port = cfg.main_process_port or DEFAULT_MULTI_MACHINE_PORT
    config_path = user_config_path(args.config_file)
    config_file = str(config_path.resolve()) if config_path is not None else None
    cwd = os.getcwd()
    env = forwarded_env(dict(os.environ), cwd, os.path.expanduser("~"))
    shared = passed_on_flags(args, launch_parser)
    ssh = ssh_command(args, os.environ)
    commands = [ssh + [m.host, remote_command(machine_argv(machines, rank, port, main_ip, shared, config_file,
                                                           script_argv), env, cwd)]
                for rank, m in enumerate(machines)]
    for machine, command in zip(machines, commands, strict=True):  # what exec refuses (E2BIG), before any starts
        longest = max(len(os.fsencode(word)) for word in command)
        if longest > MAX_ARG_BYTES:
            raise UsageError(f"the command for host {machine.host} is {longest} bytes long, over Linux's limit of "
                             f"{MAX_ARG_BYTES} for one argument; allowed: shorter values in the forwarded variables "
                             f"and {environ_file_name()} files")
    from accel.cli.checks import release_warnings

    release_warnings()  # the config's warnings, now that every check passed
    if getattr(args, "dry_run", False):  # the commands the hosts would run, nothing started
        for command in commands:
            print(shlex.join(command))
        return 0
    sys.stderr.write(f"accel launch: {len(machines)} machine(s) over {ssh[0]}, {per_host} process(es) each, main "
                     f"process {main_ip}:{port}: " + ", ".join(m.host for m in machines) + "\n")
    sys.stderr.flush()
    return run_hosts(machines, commands)


def stop_when_head_disconnects(environ=os.environ) -> None:
    """In a launcher started by `--hostfile`: when its stdin closes (the head stopped it, or the ssh
    connection dropped), SIGTERM itself, so torchrun's agent stops the workers instead of leaving them."""
    if environ.pop(HEAD_WATCH_ENV, None) != "1":
        return

    def watch() -> None:
        try:
            while os.read(0, 65536):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="accel-head-watch", daemon=True).start()
