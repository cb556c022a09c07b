"""What a cluster's scheduler says about this process: the ONE reading of each scheduler's variables, shared by
`accel launch` (accel.cli: multinode, kubeflow) and a plain `python train.py` (`task_env`, through PartialState).

The readers, one per scheduler, each naming a bad value in one line (ClusterEnvError: the variable, the value and
what is allowed), the same line under `accel launch` and under plain python:

* `read_slurm`: a SLURM job step's task variables (SLURM_PROCID, SLURM_NTASKS, SLURM_NNODES, the node list, ...);
* `read_mpi`: every MPI's launcher variables (Open MPI, MPICH/Intel MPI's Hydra, MVAPICH2: `MPI_FAMILIES`);
* `read_pet`: Kubeflow's PET_* (what torchrun reads as its flags' defaults), PET_NNODES as N or N:N;
* `read_torchrun`: torchrun's own RANK/WORLD_SIZE, when no launcher set them (a PyTorchJob pod, or by hand).

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
allocation and `accel launch` may be about to run) of more than one task. `mpi_task_env` does the same for `mpirun`.

`task_env` (plain python) first reads every scheduler whose variables are set and compares them: two that disagree on
this process's rank or on the number of processes are one line naming both variables and values (two processes
would take one rank, or wait for processes that never come); when they agree, SLURM's, else MPI's, form the group.
A Kubeflow Trainer pod (PET_*) that asks for several processes with nobody to start them is one line too. Nothing is
read in a launcher's worker (`launcher_worker`: torchrun's, accel launch's): its variables are the launcher's.

Also SLURM's host-list syntax (`node[01-04,07],login1`), read lazily: only the first host is ever used (the
main address), and a list is never expanded whole, except by `expand_hostlist`, which refuses more than
`MAX_HOSTS` hosts in one line. Imports no torch (the launcher imports this module).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from accel.config.errors import shown
from accel.config.schema import MAX_PROCESSES_PER_MACHINE

LAUNCHED_ENV = "ACCEL_LAUNCH_CONFIG"  # accel.config.LAUNCH_ENV: this process was started by `accel launch`
# a launcher's worker: torchrun (and accel launch through it) sets LOCAL_RANK and TORCHELASTIC_RUN_ID in every worker
WORKER_VARIABLES = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", LAUNCHED_ENV)
NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
PORT_BASE, PORT_SPAN = 15000, 10000  # derived ports: below Linux's ephemeral range (32768-60999)
MAX_HOSTS = 1_000_000  # hosts `expand_hostlist` lists at most (the largest machines have some 10^5 nodes)
TORCHRUN_WORDS = ("auto", "cpu", "gpu", "xpu")  # torchrun's --nproc_per_node words: it counts the devices itself


class ClusterEnvError(ValueError):
    """The scheduler's variables describe a job of several processes that cannot be formed (one line). Uncaught, it is
    printed as that line alone (accel.core.uncaught knows it by name); the launcher words it as its own error."""


# -------------------------------------------------------------------------------------------------------
# SLURM's host lists: parsed whole (a malformed list is an error wherever it is), expanded lazily
# -------------------------------------------------------------------------------------------------------

_RANGE = re.compile(r"([0-9]{1,18})(?:-([0-9]{1,18}))?")  # ASCII digits only; a host number fits in 18 digits
Ranges = tuple[tuple[int, int, int], ...]  # (low, high, zero-padded width) of one bracket group
Item = tuple[tuple[str, ...], tuple[Ranges, ...]]  # one name of a list: n + 1 literals around n bracket groups


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


def _ranges(body: str) -> Ranges:
    """`01-03,07` -> ((1, 3, 2), (7, 7, 2)): the zero padding kept, as SLURM writes it."""
    ranges = []
    for item in body.split(","):
        match = _RANGE.fullmatch(item)
        if match is None:
            raise ValueError(f"bad range {shown(item)}")
        low_text, high_text = match.groups()
        low, high = int(low_text), int(high_text or low_text)
        if high < low:
            raise ValueError(f"range {item!r} runs backwards")
        ranges.append((low, high, len(low_text) if low_text.startswith("0") else 0))
    return tuple(ranges)


def _segments(item: str) -> Item:
    """`r[1-2]n[8-9]-ib` -> (('r', 'n', '-ib'), (ranges, ranges)): the literals around the bracket groups."""
    literals: list[str] = []
    groups: list[Ranges] = []
    position = 0
    while True:
        start = item.find("[", position)
        literal = item[position:] if start < 0 else item[position:start]
        if "]" in literal:
            raise ValueError("']' without '['")
        literals.append(literal)
        if start < 0:
            return tuple(literals), tuple(groups)
        end = item.find("]", start)
        if end < 0:
            raise ValueError("'[' without ']'")
        if "[" in item[start + 1:end]:
            raise ValueError("nested brackets")
        groups.append(_ranges(item[start + 1:end]))
        position = end + 1


def _item_hosts(item: Item) -> Iterator[str]:
    """The hosts of one item, in SLURM's order (the last bracket group varies fastest), one at a time: an odometer
    over the groups, without recursion (an item may hold thousands of groups) and without listing a range."""
    literals, groups = item
    state = [(0, ranges[0][0]) for ranges in groups]  # per group: the index of its current range, its current value
    while True:
        parts = [literals[0]]
        for (range_index, value), ranges, literal in zip(state, groups, literals[1:], strict=True):
            parts += [str(value).zfill(ranges[range_index][2]), literal]
        yield "".join(parts)
        position = len(groups) - 1
        while position >= 0:
            ranges, (range_index, value) = groups[position], state[position]
            if value < ranges[range_index][1]:
                state[position] = (range_index, value + 1)
                break
            if range_index + 1 < len(ranges):
                state[position] = (range_index + 1, ranges[range_index + 1][0])
                break
            state[position] = (0, ranges[0][0])  # this group starts over; the one before it moves on
            position -= 1
        if position < 0:
            return


@dataclass(frozen=True)
class HostList:
    """A SLURM host list, parsed (every range checked) but not expanded: `first()`, `count`, `iter(...)`."""

    items: tuple[Item, ...]

    @property
    def count(self) -> int:
        """How many hosts it names (several bracket groups in one name multiply), counted without listing them."""
        total = 0
        for _, groups in self.items:
            product = 1
            for ranges in groups:
                product *= sum(high - low + 1 for low, high, _ in ranges)
            total += product
        return total

    def first(self) -> str:
        return next(iter(self))

    def __iter__(self) -> Iterator[str]:
        for item in self.items:
            yield from _item_hosts(item)


def parse_hostlist(text: str) -> HostList:
    """SLURM's hostlist syntax, checked whole (ValueError, one line, when malformed) and left unexpanded."""
    items = []
    for item in _split_top_level(text.strip()):
        if not item:
            raise ValueError("empty host name")
        items.append(_segments(item))
    return HostList(tuple(items))


def first_host(text: str) -> str:
    """The first host of a SLURM host list (where task 0 runs), without expanding the rest of it."""
    return parse_hostlist(text).first()


def iter_hostlist(text: str) -> Iterator[str]:
    """The hosts of a SLURM host list, one at a time (as many as the caller takes)."""
    return iter(parse_hostlist(text))


def expand_hostlist(text: str, limit: int = MAX_HOSTS) -> list[str]:
    """SLURM's hostlist syntax -> host names: `node[01-04,07],login1` -> node01..node04, node07, login1;
    several bracket groups multiply (`r[1-2]n[1-2]` -> r1n1, r1n2, r2n1, r2n2). ValueError when malformed, or
    when it names more than `limit` hosts (counted before any is listed). Where one host is enough: `first_host`."""
    hosts = parse_hostlist(text)
    if hosts.count > limit:
        raise ValueError(f"it names more than {limit:,} hosts (at most {limit:,} are listed)")
    return list(hosts)


# -------------------------------------------------------------------------------------------------------
# integers, the readers' common ground
# -------------------------------------------------------------------------------------------------------

def _int(env: Mapping[str, str], names: tuple[str, ...], allowed: str, setter: str) -> tuple[str, int] | None:
    """(name, value) of the first of `names` set (not empty) in `env`, or None; a value that is not an integer is one
    line naming it, with what is `allowed` and who sets it."""
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return name, int(value)
            except ValueError:
                raise ClusterEnvError(f"${name}={shown(value)} is not an integer; allowed: {allowed} ({setter} sets "
                                      "it)") from None
    return None


def launcher_worker(env: Mapping[str, str]) -> bool:
    """A launcher started this process: torchrun (and accel launch through it) sets LOCAL_RANK and TORCHELASTIC_RUN_ID
    in every worker, and accel launch hands its workers their config. Its RANK/WORLD_SIZE are then process ranks, and
    a scheduler's variables around it describe the launchers (one per node), not this process."""
    return any(env.get(name) not in (None, "") for name in WORKER_VARIABLES)


def derived_port(job_id: str, step_id: str) -> int:
    """The port every task of one SLURM step derives alike: PORT_BASE + crc32('job.step') mod PORT_SPAN."""
    return PORT_BASE + zlib.crc32(f"{job_id}.{step_id}".encode()) % PORT_SPAN


# -------------------------------------------------------------------------------------------------------
# SLURM
# -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SlurmStep:
    """What SLURM set for this task of a job step: (variable, value) pairs, each None when unset."""

    step_id: str
    tasks: tuple[str, int] | None  # SLURM_STEP_NUM_TASKS, else SLURM_NTASKS
    nodes: tuple[str, int] | None  # SLURM_STEP_NUM_NODES, else SLURM_NNODES, else SLURM_JOB_NUM_NODES
    procid: tuple[str, int] | None  # this task's rank in the step
    localid: tuple[str, int] | None  # this task's index on its node
    nodeid: tuple[str, int] | None  # this node's index in the step
    job_id: tuple[str, int] | None
    nodelist: str | None  # the first of NODELIST_VARIABLES set

    def main_host(self, env: Mapping[str, str], fix: str) -> str | None:
        """The first host of the node list (task 0's), or None without one; `fix` ends the line of a bad list."""
        if self.nodelist is None:
            return None
        try:
            return first_host(env[self.nodelist])
        except ValueError as exc:
            raise ClusterEnvError(f"${self.nodelist}={shown(env[self.nodelist])} is not a SLURM host list ({exc}); "
                                  f"allowed: e.g. node[01-04],login1, or {fix}") from None


def read_slurm(env: Mapping[str, str]) -> SlurmStep | None:
    """SLURM's variables in a job step (`srun`), or None outside one (a batch script, salloc's shell)."""
    step_id = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    if not step_id:
        return None
    return SlurmStep(
        step_id=step_id,
        tasks=_int(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), "the number of tasks of the step", "SLURM"),
        nodes=_int(env, ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
                   "the number of nodes of the step", "SLURM"),
        procid=_int(env, ("SLURM_PROCID",), "this task's rank, from 0", "srun"),
        localid=_int(env, ("SLURM_LOCALID",), "this task's index on its node, from 0", "srun"),
        nodeid=_int(env, ("SLURM_NODEID",), "this node's index in the step, from 0", "srun"),
        job_id=_int(env, ("SLURM_JOB_ID", "SLURM_JOBID"), "the job id", "SLURM"),
        nodelist=next((name for name in NODELIST_VARIABLES if env.get(name)), None),
    )


def slurm_task_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """torchrun's variables for this task of an `srun` step of several tasks, or None when this is not one (or is a
    launcher's worker). ClusterEnvError (one line) when the group cannot be formed. Other schedulers' variables are
    compared by `task_env`."""
    step = read_slurm(env)
    if step is None or launcher_worker(env) or step.tasks is None or step.tasks[1] <= 1:
        return None
    tasks = step.tasks
    where = f"srun step of {tasks[1]} tasks (${tasks[0]}) without a launcher"
    rank = step.procid
    if rank is None or not 0 <= rank[1] < tasks[1]:
        shown_rank = " is unset" if rank is None else f"={rank[1]}"
        raise ClusterEnvError(f"{where}: $SLURM_PROCID{shown_rank}; allowed: 0 to {tasks[1] - 1} (this task's rank, "
                              "set by srun)")
    local = step.localid
    if local is None or local[1] < 0:
        shown_local = " is unset" if local is None else f"={local[1]}"
        raise ClusterEnvError(f"{where}: $SLURM_LOCALID{shown_local}; allowed: 0 or more (this task's index on its "
                              "node, set by srun)")
    address = env.get("MASTER_ADDR") or None
    if address is None:
        try:
            address = step.main_host(env, "set MASTER_ADDR")
        except ClusterEnvError as exc:
            raise ClusterEnvError(f"{where}: {exc}") from None
        if address is None:
            raise ClusterEnvError(f"{where}: none of ${', $'.join(NODELIST_VARIABLES)} is set, so the address of "
                                  "task 0 is unknown; set MASTER_ADDR, or start the tasks with `srun accel launch`")
    port = env.get("MASTER_PORT") or None
    if port is None:
        if step.job_id is None:
            raise ClusterEnvError(f"{where}: $SLURM_JOB_ID is unset, so no port can be derived for the group; set "
                                  "MASTER_PORT")
        port = str(derived_port(str(step.job_id[1]), step.step_id))
    found = {"RANK": str(rank[1]), "WORLD_SIZE": str(tasks[1]), "LOCAL_RANK": str(local[1]),
             "MASTER_ADDR": address, "MASTER_PORT": port}
    if step.nodeid is not None:
        found["NODE_RANK"] = str(step.nodeid[1])
    return found


# -------------------------------------------------------------------------------------------------------
# MPI
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


@dataclass(frozen=True)
class MpiWorld:
    """One MPI's variables: its family, the variables' names, and their values (None: unset)."""

    family: str
    size_var: str
    size: int
    rank_var: str
    rank: int | None
    local_var: str
    local: int | None
    local_size_var: str
    local_size: int | None


def read_mpi(env: Mapping[str, str]) -> list[MpiWorld]:
    """Every MPI whose world size variable is set, in MPI_FAMILIES' order."""
    worlds = []
    for family, (size_var, rank_var, local_var, local_size_var) in MPI_FAMILIES:
        setter = f"{family}'s mpirun"
        size = _int(env, (size_var,), "the number of processes", setter)
        if size is None:
            continue
        rank = _int(env, (rank_var,), f"0 to {size[1] - 1}", setter)
        local = _int(env, (local_var,), "this process's index on its machine", setter)
        local_size = _int(env, (local_size_var,), "the number of processes on this machine", setter)
        worlds.append(MpiWorld(family, size_var, size[1], rank_var, None if rank is None else rank[1], local_var,
                               None if local is None else local[1], local_size_var,
                               None if local_size is None else local_size[1]))
    return worlds


def mpi_task_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """torchrun's variables for this process of an `mpirun -np N python train.py` (N > 1), or None when this is not
    one (or is a launcher's worker). MASTER_ADDR: $MASTER_ADDR, else 127.0.0.1 when every process is on this machine
    (local size = world size), else a one-line error (MPI names no host for rank 0); MASTER_PORT: $MASTER_PORT, else
    one derived from the PMIx namespace, else 29500. The first MPI of MPI_FAMILIES set is read (`task_env` checks
    that the others agree)."""
    if launcher_worker(env):
        return None
    worlds = read_mpi(env)
    if not worlds or worlds[0].size <= 1:
        return None
    world = worlds[0]
    size, rank, local, local_size = world.size, world.rank, world.local, world.local_size
    where = f"mpirun of {size} processes (${world.size_var}, {world.family}) without a launcher"
    if rank is None or not 0 <= rank < size:
        shown_rank = " is unset" if rank is None else f"={rank}"
        raise ClusterEnvError(f"{where}: ${world.rank_var}{shown_rank}; allowed: 0 to {size - 1} (this process's "
                              "rank, set by mpirun)")
    address = env.get("MASTER_ADDR") or None
    if address is None:
        if local_size != size:
            shown_size = " is unset" if local_size is None else f"={local_size} (of {size})"
            raise ClusterEnvError(f"{where}: ${world.local_size_var}{shown_size}, so rank 0 may be on another machine "
                                  "and its address is unknown; export MASTER_ADDR=<rank 0's host> (mpirun -x "
                                  "MASTER_ADDR), or start one `accel launch` per machine")
        address = "127.0.0.1"
    port = env.get("MASTER_PORT") or None
    if port is None:
        namespace = env.get("PMIX_NAMESPACE")
        port = str(derived_port(namespace, "mpi") if namespace else MPI_DEFAULT_PORT)
    if local is None and local_size != size:
        raise ClusterEnvError(f"{where}: ${world.local_var} is unset, so this process's GPU is unknown; allowed: "
                              "an MPI whose mpirun sets it, or start one `accel launch` per machine")
    found = {"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": address, "MASTER_PORT": port,
             "LOCAL_RANK": str(rank if local is None else local)}  # (unset: one machine, so the rank)
    if local_size is not None:
        found["LOCAL_WORLD_SIZE"] = str(local_size)
    return found


# -------------------------------------------------------------------------------------------------------
# Kubeflow's PET_* (Kubeflow Trainer's torch runtime; PyTorchJob sets them too)
# -------------------------------------------------------------------------------------------------------

PET = "Kubeflow Trainer"
PET_NAMES = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
NNODES_ALLOWED = "a whole number of nodes from 1, or MIN:MAX with MIN equal to MAX"
NPROC_ALLOWED = (f"a whole number of processes per node from 1 to {MAX_PROCESSES_PER_MACHINE} (torchrun's "
                 f"{', '.join(TORCHRUN_WORDS)} are not taken: Kubeflow Trainer resolves numProcPerNode to a number)")


@dataclass(frozen=True)
class PetEnv:
    """Kubeflow's PET_* as torchrun would read them; `nnodes_text`/`nproc` keep what was written (for the lines)."""

    nnodes: int | None
    nnodes_text: str | None
    nproc: int | str | None  # a number, or one of torchrun's TORCHRUN_WORDS
    node_rank: int | None
    master_addr: str | None
    master_port: int | None

    def processes_per_node(self) -> int | None:
        """PET_NPROC_PER_NODE as a number (None: unset); torchrun's words are one line where the count is needed."""
        if isinstance(self.nproc, str):
            raise ClusterEnvError(f"$PET_NPROC_PER_NODE={shown(self.nproc)}: bad value; allowed: {NPROC_ALLOWED}")
        return self.nproc

    def named(self, per_node: bool) -> str:
        """`$PET_NNODES=2:2`, with `per_node` times `$PET_NPROC_PER_NODE=4` when that is a number: a count's
        variables."""
        parts = [f"$PET_NNODES={self.nnodes_text}"] if self.nnodes_text is not None else []
        if per_node and isinstance(self.nproc, int):
            parts.append(f"$PET_NPROC_PER_NODE={self.nproc}")
        return " x ".join(parts)


def _text(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    return None if value is None or not value.strip() else value.strip()


def _whole(text: str) -> int | None:
    """A whole number written in ASCII digits (at most 18), else None."""
    text = text.strip()
    return int(text) if re.fullmatch(r"[0-9]{1,18}", text) else None


def _pet_number(env: Mapping[str, str], name: str, low: int, high: int | None, allowed: str) -> int | None:
    value = _text(env, name)
    if value is None:
        return None
    number = _whole(value)
    if number is None or number < low or (high is not None and number > high):
        raise ClusterEnvError(f"${name}={shown(value)}: bad value; allowed: {allowed}")
    return number


def read_pet(env: Mapping[str, str]) -> PetEnv | None:
    """PET_* as torchrun reads them, or None when none is set. PET_NNODES: N, or torchrun's MIN:MAX with MIN = MAX
    (what Kubeflow writes for an elastic policy); a real range is one line (accel runs a fixed number of machines)."""
    if not any(_text(env, name) for name in PET_NAMES):
        return None
    nnodes_text = _text(env, "PET_NNODES")
    nnodes = None
    if nnodes_text is not None:
        low, colon, high = nnodes_text.partition(":")
        numbers = [_whole(low), _whole(high) if colon else _whole(low)]  # N is N:N
        if numbers[0] is None or numbers[1] is None or not 1 <= numbers[0] <= numbers[1]:
            raise ClusterEnvError(f"$PET_NNODES={shown(nnodes_text)}: bad value; allowed: {NNODES_ALLOWED}")
        if numbers[0] != numbers[1]:
            raise ClusterEnvError(f"$PET_NNODES={shown(nnodes_text)}: an elastic range of nodes; allowed: a fixed "
                                  "number of nodes, N or N:N (accel runs a fixed number of machines)")
        nnodes = numbers[0]
    nproc_text = _text(env, "PET_NPROC_PER_NODE")
    nproc: int | str | None = nproc_text
    if nproc_text is not None and nproc_text not in TORCHRUN_WORDS:
        nproc = _pet_number(env, "PET_NPROC_PER_NODE", 1, MAX_PROCESSES_PER_MACHINE, NPROC_ALLOWED)
    return PetEnv(
        nnodes=nnodes, nnodes_text=nnodes_text, nproc=nproc,
        node_rank=_pet_number(env, "PET_NODE_RANK", 0, None, "this node's rank, a whole number from 0"),
        master_addr=_text(env, "PET_MASTER_ADDR"),
        master_port=_pet_number(env, "PET_MASTER_PORT", 1, 65535, "a port number from 1 to 65535"),
    )


# -------------------------------------------------------------------------------------------------------
# torchrun's own RANK/WORLD_SIZE, set without a launcher
# -------------------------------------------------------------------------------------------------------

def read_torchrun(env: Mapping[str, str]) -> tuple[tuple[str, int] | None, tuple[str, int] | None] | None:
    """(WORLD_SIZE, RANK) as (variable, value) pairs (each None when unset), or None when neither is set or a launcher
    set them (`launcher_worker`): then they are the launcher's, and nothing is compared with them."""
    if launcher_worker(env):
        return None
    size = _int(env, ("WORLD_SIZE",), "the number of processes, from 1", "torchrun")
    rank = _int(env, ("RANK",), "this process's rank, from 0", "torchrun")
    return None if size is None and rank is None else (size, rank)


# -------------------------------------------------------------------------------------------------------
# every scheduler against every other
# -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Claim:
    """What one scheduler's variables say: how many there are (processes, or machines) and which one this is, each as
    (how its variables read, the value), None when they do not say."""

    who: str
    size: tuple[str, int] | None
    rank: tuple[str, int] | None


ONE_SCHEDULER = ("allowed: the variables of the one scheduler that started the processes (unset the other's), or "
                 "values that agree")


def check_agreement(claims: list[Claim], what: str = "processes", also: str = "") -> None:
    """Every claim against every other: two that disagree on the count (`what`: processes, or machines) or on this
    one's rank are one line naming both variables and their values (`also`: more that is allowed)."""
    allowed = ONE_SCHEDULER + also
    for i, a in enumerate(claims):
        for b in claims[i + 1:]:
            if a.size is not None and b.size is not None and a.size[1] != b.size[1]:
                raise ClusterEnvError(f"{a.size[0]} ({a.who}) and {b.size[0]} ({b.who}) disagree on the number of "
                                      f"{what}, so the job cannot be formed; {allowed}")
            if a.rank is not None and b.rank is not None and a.rank[1] != b.rank[1]:
                one = "machine" if what == "machines" else "process"
                raise ClusterEnvError(f"{a.rank[0]} ({a.who}) and {b.rank[0]} ({b.who}) disagree on this {one}'s rank, "
                                      f"so two {what} would take one rank; {allowed}")


def _named(pair: tuple[str, int] | None) -> tuple[str, int] | None:
    return None if pair is None else (f"${pair[0]}={pair[1]}", pair[1])


TORCHRUN = "torchrun's variable, set without a launcher"


def _mpi_claims(env: Mapping[str, str]) -> list[Claim]:
    return [Claim(world.family, (f"${world.size_var}={world.size}", world.size),
                  None if world.rank is None else (f"${world.rank_var}={world.rank}", world.rank))
            for world in read_mpi(env) if world.size > 1]


def process_claims(env: Mapping[str, str]) -> tuple[list[Claim], PetEnv | None]:
    """Each scheduler's word on this process (plain python), and PET_* as read. A scheduler whose job has one process
    or task says nothing about this one (a launcher inside it starts the processes: mpirun under `srun -n1`)."""
    claims = []
    torchrun = read_torchrun(env)
    if torchrun is not None:
        claims.append(Claim(TORCHRUN, _named(torchrun[0]), _named(torchrun[1])))
    step = read_slurm(env)
    if step is not None and step.tasks is not None and step.tasks[1] > 1:
        claims.append(Claim("SLURM", _named(step.tasks), _named(step.procid)))
    claims += _mpi_claims(env)
    pet = read_pet(env)
    if pet is not None:
        # torchrun's words count devices when it starts; PyTorchJob's WORLD_SIZE/RANK take them as 1 process per pod
        per_node = (pet.nproc or 1) if not isinstance(pet.nproc, str) else 1 if torchrun is not None else None
        if per_node is not None and (pet.nnodes or 1) * per_node > 1:
            rank = pet.node_rank if per_node == 1 else None  # one process per node: the node's rank is its rank
            claims.append(Claim(PET, (pet.named(per_node=True), (pet.nnodes or 1) * per_node),
                                None if rank is None else (f"$PET_NODE_RANK={rank}", rank)))
    return claims, pet


def _refuse_pet_without_launcher(pet: PetEnv, claims: list[Claim]) -> None:
    """Kubeflow Trainer's torch runtime sets PET_NNODES/PET_NPROC_PER_NODE for torchrun (or `accel launch`) to start
    the pod's processes. A pod whose command is `python train.py` runs one process: with more than one asked for and
    no other scheduler having started them, each pod would train alone. One line instead. A PyTorchJob pod of one
    process per pod (its WORLD_SIZE/RANK count pods, as PET_NNODES/PET_NODE_RANK do) is such a process: fine."""
    if any(claim.who not in (PET, TORCHRUN) for claim in claims):
        return  # srun or mpirun started the processes, and PET_* agree with them
    torchrun = any(claim.who == TORCHRUN for claim in claims)
    if isinstance(pet.nproc, str) and torchrun:
        return  # PyTorchJob's default `auto`: one process per pod, as its WORLD_SIZE says
    # torchrun's word without torchrun: one line, as under accel launch (how many it would start is unknown here)
    per_node = pet.processes_per_node() or 1
    if (pet.nnodes or 1) * per_node <= 1 or (torchrun and per_node == 1):
        return
    name, value = ("PET_NPROC_PER_NODE", per_node) if per_node > 1 else ("PET_NNODES", pet.nnodes_text)
    raise ClusterEnvError(f"${name}={value} ({PET}) asks for several processes, but this one was started without a "
                          "launcher and would train alone; allowed: the TrainJob's command `accel launch train.py` "
                          "(or torchrun), which starts them")


def task_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """Plain python (no launcher started this process): torchrun's variables from the scheduler that started it, or
    None when there is none to take (one process; a launcher's worker; only torchrun's own variables set). Every
    scheduler's variables are compared with every other's first. ClusterEnvError (one line) when two disagree,
    when a PET_* pod asks for processes nobody starts, or when the group cannot be formed."""
    if launcher_worker(env):
        return None
    claims, pet = process_claims(env)
    check_agreement(claims)
    if pet is not None:
        _refuse_pet_without_launcher(pet, claims)
    return slurm_task_env(env) or mpi_task_env(env)


def export_task_env(environ=None) -> dict[str, str] | None:
    """Set what `task_env` finds in `environ` (os.environ when None): the process group, and everything else that
    reads RANK, then see the job the scheduler started. Returns it."""
    import os

    environ = os.environ if environ is None else environ
    found = task_env(environ)
    if found:
        environ.update(found)
    return found


# -------------------------------------------------------------------------------------------------------
# accel launch: the machine-level word of each scheduler (one launcher per machine)
# -------------------------------------------------------------------------------------------------------

def machine_claims(env: Mapping[str, str]) -> list[Claim]:
    """What SLURM (a step of several nodes), Kubeflow's PET_* and MPI (several launchers) say about the machines
    under `accel launch`: their count and this machine's rank. (A pod's WORLD_SIZE/RANK are left out: they count
    pods or processes, depending on the operator, accel/cli/kubeflow.py.)"""
    claims = []
    step = read_slurm(env)
    if step is not None and step.nodes is not None and step.nodes[1] > 1:
        claims.append(Claim("SLURM", _named(step.nodes), _named(step.procid or step.nodeid)))
    pet = read_pet(env)
    if pet is not None and pet.nnodes is not None:
        rank = None if pet.node_rank is None else (f"$PET_NODE_RANK={pet.node_rank}", pet.node_rank)
        claims.append(Claim(PET, (pet.named(per_node=False), pet.nnodes), rank))
    return claims + _mpi_claims(env)


def check_machines(env: Mapping[str, str], given: Mapping[str, object]) -> None:
    """Under `accel launch`: the schedulers' machine counts and ranks, every one against every other, except what a
    flag gives (`given`: num_machines, machine_rank), which is meant. One line when two disagree."""
    claims = [Claim(c.who, None if given.get("num_machines") is not None else c.size,
                    None if given.get("machine_rank") is not None else c.rank) for c in machine_claims(env)]
    check_agreement(claims, "machines", ", or --num_machines and --machine_rank, which win")
