"""What a cluster's scheduler says about this process, when no launcher did: SLURM's task variables under `srun`,
and MPI's under `mpirun` (`mpi_task_env`, at the end).

`srun --ntasks-per-node=2 python train.py` (Lightning's way, no `accel launch`, no torchrun) starts every task with
SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and the step's node list but none of torchrun's RANK/WORLD_SIZE/LOCAL_RANK.
`slurm_task_env` turns them into torchrun's variables, which `PartialState` then reads as under a launcher:

    RANK = SLURM_PROCID, WORLD_SIZE = SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), LOCAL_RANK = SLURM_LOCALID,
    NODE_RANK = SLURM_NODEID (when set),
    MASTER_ADDR = $MASTER_ADDR if set, else the first host of SLURM_STEP_NODELIST (else SLURM_NODELIST,
                  SLURM_JOB_NODELIST): task 0 runs there,
    MASTER_PORT = $MASTER_PORT if set, else 15000-24999 derived from SLURM_JOB_ID and SLURM_STEP_ID (every task of
                  the step derives the same one; two steps of one job running side by side get different ones).

Only in a job step (SLURM_STEP_ID or SLURM_STEPID set: not the batch script itself, where SLURM_NTASKS describes the
allocation and `accel launch` may be about to run) of more than one task, and only when no launcher set RANK,
WORLD_SIZE or LOCAL_RANK (`srun accel launch`'s workers have them) and `accel launch` did not start this process.
Such a step whose group cannot be formed (no node list, a bad value) is a one-line error: never N independent jobs.

Also SLURM's host-list syntax (`node[01-04,07],login1`), shared with `srun accel launch` (cli/multinode.py).
Imports no torch (the launcher imports this module).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Mapping

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")  # set by torchrun (and accel launch through it)
LAUNCHED_ENV = "ACCEL_LAUNCH_CONFIG"  # accel.config.LAUNCH_ENV: this process was started by `accel launch`
NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
PORT_BASE, PORT_SPAN = 15000, 10000  # derived ports: below Linux's ephemeral range (32768-60999)


class ClusterEnvError(ValueError):
    """The scheduler's variables describe a job of several processes that cannot be formed (one line)."""


# -------------------------------------------------------------------------------------------------------
# SLURM's host lists
# -------------------------------------------------------------------------------------------------------

_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def _split_top_level(text: str) -> list[str]:
    """Split at the commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("'[' without ']'")
    parts.append(text[start:])
    return parts


def _expand_range_list(body: str) -> list[str]:
    """`01-03,07` -> ['01', '02', '03', '07'] (zero padding kept, as SLURM writes it)."""
    values = []
    for item in body.split(","):
        low, sep, high = item.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"bad range {item!r}")
        if not sep:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"range {item!r} runs backwards")
        width = len(low) if low.startswith("0") else 0
        values += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return values


def _expand_one(item: str) -> list[str]:
    match = _BRACKET.search(item)
    if match is None:
        if "[" in item or "]" in item:
            raise ValueError("nested or unbalanced brackets")
        return [item]
    head, tail = item[:match.start()], item[match.end():]
    return [head + value + rest for value in _expand_range_list(match.group(1)) for rest in _expand_one(tail)]


def expand_hostlist(text: str) -> list[str]:
    """SLURM's hostlist syntax -> host names: `node[01-04,07],login1` -> node01..node04, node07, login1;
    several bracket groups multiply (`r[1-2]n[1-2]` -> r1n1, r1n2, r2n1, r2n2). ValueError when malformed."""
    hosts = []
    for item in _split_top_level(text.strip()):
        if not item:
            raise ValueError("empty host name")
        hosts += _expand_one(item)
    return hosts


# -------------------------------------------------------------------------------------------------------
# srun without a launcher
# -------------------------------------------------------------------------------------------------------

def first_int(env: Mapping[str, str], names: tuple[str, ...],
              error: Callable[[str, str], Exception]) -> tuple[str, int] | None:
    """(name, value) of the first of `names` set in `env`; a value that is not an integer raises error(name, value).
    Shared with `srun accel launch` (cli/multinode.py), which words its own error."""
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return name, int(value)
            except ValueError:
                raise error(name, value) from None
    return None


def _int(env: Mapping[str, str], names: tuple[str, ...], what: str) -> tuple[str, int] | None:
    return first_int(env, names, lambda name, value: ClusterEnvError(
        f"srun without a launcher: ${name}={value!r} is not an integer; allowed: {what} (SLURM sets it)"))


def _launched(env: Mapping[str, str]) -> bool:
    """A launcher started this process: torchrun's variables are set, or `accel launch` handed it its config."""
    return bool(env.get(LAUNCHED_ENV)) or any(env.get(name) not in (None, "") for name in LAUNCHER_VARIABLES)


def derived_port(job_id: str, step_id: str) -> int:
    """The port every task of one SLURM step derives alike: PORT_BASE + crc32('job.step') mod PORT_SPAN."""
    return PORT_BASE + zlib.crc32(f"{job_id}.{step_id}".encode()) % PORT_SPAN


def slurm_task_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """torchrun's variables for this task of an `srun` step of several tasks started without a launcher, or None
    when this is not one (see the module's docstring). ClusterEnvError (one line) when the group cannot be formed."""
    step_id = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    if not step_id or _launched(env):
        return None
    tasks = _int(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), "the number of tasks of the step")
    if tasks is None or tasks[1] <= 1:
        return None
    where = f"srun step of {tasks[1]} tasks (${tasks[0]}) without a launcher"
    rank = _int(env, ("SLURM_PROCID",), f"0 to {tasks[1] - 1}")
    if rank is None or not 0 <= rank[1] < tasks[1]:
        shown = " is unset" if rank is None else f"={rank[1]}"
        raise ClusterEnvError(f"{where}: $SLURM_PROCID{shown}; allowed: 0 to {tasks[1] - 1} (this task's rank, "
                              "set by srun)")
    local = _int(env, ("SLURM_LOCALID",), "this task's index on its node")
    if local is None or local[1] < 0:
        shown = " is unset" if local is None else f"={local[1]}"
        raise ClusterEnvError(f"{where}: $SLURM_LOCALID{shown}; allowed: 0 or more (this task's index on its "
                              "node, set by srun)")
    address = env.get("MASTER_ADDR") or None
    if address is None:
        name = next((n for n in NODELIST_VARIABLES if env.get(n)), None)
        if name is None:
            raise ClusterEnvError(f"{where}: none of ${', $'.join(NODELIST_VARIABLES)} is set, so the address of "
                                  "task 0 is unknown; set MASTER_ADDR, or start the tasks with `srun accel launch`")
        try:
            address = expand_hostlist(env[name])[0]
        except ValueError as exc:
            raise ClusterEnvError(f"{where}: ${name}={env[name]!r} is not a SLURM host list ({exc}); allowed: "
                                  "e.g. node[01-04],login1, or set MASTER_ADDR") from None
    port = env.get("MASTER_PORT") or None
    if port is None:
        job = _int(env, ("SLURM_JOB_ID", "SLURM_JOBID"), "the job id")
        if job is None:
            raise ClusterEnvError(f"{where}: $SLURM_JOB_ID is unset, so no port can be derived for the group; set "
                                  "MASTER_PORT")
        port = str(derived_port(str(job[1]), step_id))
    found = {"RANK": str(rank[1]), "WORLD_SIZE": str(tasks[1]), "LOCAL_RANK": str(local[1]),
             "MASTER_ADDR": address, "MASTER_PORT": port}
    node = _int(env, ("SLURM_NODEID",), "this node's index in the step")
    if node is not None:
        found["NODE_RANK"] = str(node[1])
    return found


def export_slurm_task_env(environ=None) -> dict[str, str] | None:
    """Under `srun` without a launcher, set torchrun's variables from SLURM's (`slurm_task_env`) in `environ`
    (os.environ): the process group, and everything else that reads RANK, then see the job SLURM started."""
    return _export(slurm_task_env, environ)


def _export(task_env: Callable[[Mapping[str, str]], dict[str, str] | None], environ) -> dict[str, str] | None:
    """Set what `task_env` finds in `environ` (os.environ when None); returns it."""
    import os

    environ = os.environ if environ is None else environ
    found = task_env(environ)
    if found:
        environ.update(found)
    return found


# -------------------------------------------------------------------------------------------------------
# mpirun without a launcher
# -------------------------------------------------------------------------------------------------------

# (world size, rank, local rank, local size) for each MPI's launcher: Open MPI's mpirun/prterun, MPICH's and Intel
# MPI's Hydra (mpiexec), MVAPICH2's mpirun_rsh. Accelerate reads the same ones (on the CPU).
MPI_FAMILIES = (
    ("Open MPI", ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                  "OMPI_COMM_WORLD_LOCAL_SIZE")),
    ("MPICH/Intel MPI", ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")),
    ("MVAPICH2", ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
                  "MV2_COMM_WORLD_LOCAL_SIZE")),
)
MPI_DEFAULT_PORT = 29500  # Accelerate's under mpirun; a PMIx namespace (Open MPI 5, srun --mpi=pmix) derives one


def mpi_task_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """torchrun's variables for this process of an `mpirun -np N python train.py` (N > 1) started without a launcher,
    or None when this is not one. As for `srun`: only where no launcher set RANK/WORLD_SIZE/LOCAL_RANK and `accel
    launch` did not start this process. MASTER_ADDR: $MASTER_ADDR, else 127.0.0.1 when every process is on this
    machine (local size = world size), else a one-line error (MPI names no host for rank 0); MASTER_PORT:
    $MASTER_PORT, else one derived from the PMIx namespace, else 29500."""
    if _launched(env):
        return None
    for family, (size_var, rank_var, local_var, local_size_var) in MPI_FAMILIES:
        size = _mpi_int(env, size_var, family, "the number of processes")
        if size is None:
            continue
        if size <= 1:
            return None
        where = f"mpirun of {size} processes (${size_var}, {family}) without a launcher"
        rank = _mpi_int(env, rank_var, family, f"0 to {size - 1}")
        if rank is None or not 0 <= rank < size:
            shown = " is unset" if rank is None else f"={rank}"
            raise ClusterEnvError(f"{where}: ${rank_var}{shown}; allowed: 0 to {size - 1} (this process's rank, set "
                                  "by mpirun)")
        local = _mpi_int(env, local_var, family, "this process's index on its machine")
        local_size = _mpi_int(env, local_size_var, family, "the number of processes on this machine")
        address = env.get("MASTER_ADDR") or None
        if address is None:
            if local_size != size:
                shown = " is unset" if local_size is None else f"={local_size} (of {size})"
                raise ClusterEnvError(f"{where}: ${local_size_var}{shown}, so rank 0 may be on another machine and "
                                      "its address is unknown; export MASTER_ADDR=<rank 0's host> (mpirun -x "
                                      "MASTER_ADDR), or start one `accel launch` per machine")
            address = "127.0.0.1"
        port = env.get("MASTER_PORT") or None
        if port is None:
            namespace = env.get("PMIX_NAMESPACE")
            port = str(derived_port(namespace, "mpi") if namespace else MPI_DEFAULT_PORT)
        if local is None and local_size != size:
            raise ClusterEnvError(f"{where}: ${local_var} is unset, so this process's GPU is unknown; allowed: "
                                  "an MPI whose mpirun sets it, or start one `accel launch` per machine")
        found = {"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": address, "MASTER_PORT": port,
                 "LOCAL_RANK": str(rank if local is None else local)}  # (unset: one machine, so the rank)
        if local_size is not None:
            found["LOCAL_WORLD_SIZE"] = str(local_size)
        return found
    return None


def _mpi_int(env: Mapping[str, str], name: str, family: str, what: str) -> int | None:
    found = first_int(env, (name,), lambda name, value: ClusterEnvError(
        f"mpirun without a launcher: ${name}={value!r} is not an integer; allowed: {what} ({family}'s mpirun sets it)"))
    return None if found is None else found[1]


def export_mpi_task_env(environ=None) -> dict[str, str] | None:
    """Under `mpirun` without a launcher, set torchrun's variables from MPI's (`mpi_task_env`) in `environ`."""
    return _export(mpi_task_env, environ)


# -------------------------------------------------------------------------------------------------------
# a Kubeflow Trainer pod whose command is not a launcher
# -------------------------------------------------------------------------------------------------------

def refuse_pet_without_launcher(env: Mapping[str, str]) -> None:
    """Kubeflow Trainer's torch runtime sets PET_NNODES/PET_NPROC_PER_NODE for torchrun (or `accel launch`) to start
    the pod's processes. A pod whose command is `python train.py` runs one process that sees none of torchrun's
    variables: with more than one node or process asked for, each pod would train alone. One line instead."""
    if _launched(env):
        return
    for name in ("PET_NNODES", "PET_NPROC_PER_NODE"):
        value = (env.get(name) or "").strip()
        if value.isdigit() and int(value) > 1:
            raise ClusterEnvError(f"${name}={value} (Kubeflow Trainer) asks for several processes, but this one was "
                                  "started without a launcher and would train alone; allowed: the TrainJob's command "
                                  "`accel launch train.py` (or torchrun), which starts them")
