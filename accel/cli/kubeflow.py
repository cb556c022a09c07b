"""`accel launch` in a Kubernetes pod: Kubeflow Trainer's `PET_*` variables and PyTorchJob's per-pod WORLD_SIZE/RANK.

Kubeflow Trainer v2 (a TrainJob on the torch runtime) sets in every pod what torchrun reads as the defaults of its
flags (torchrun's argparse `env` action: `--nnodes` defaults to $PET_NNODES, and so on). accel launch reads them as
the values of its own settings:

    PET_NNODES          -> num_machines (N, or N:N as Kubeflow writes it for an elastic policy of fixed size)
    PET_NPROC_PER_NODE  -> num_processes = PET_NPROC_PER_NODE x num_machines (accel's num_processes is the total;
                           torchrun's auto/cpu/gpu are one line unless a flag or the file gives num_processes)
    PET_NODE_RANK       -> machine_rank
    PET_MASTER_ADDR     -> main_process_ip    } for several machines only: one machine meets on 127.0.0.1
    PET_MASTER_PORT     -> main_process_port  } on a free port, as without them

The variables are read by accel.runtime.cluster_env (`read_pet`), as under a plain `python train.py`: a value reads,
or is refused, alike under both. Precedence, key by key: `accel launch` flags (and `srun`'s values) > the config
file > PET_* > accel's defaults. torchrun's own order is flag > PET_* > default (it has no file); Accelerate's
`accelerate launch` ignores PET_* altogether (it fills torchrun's arguments from its flags and file, so
PET_NPROC_PER_NODE=2 starts one process).
One exception to "the file wins": every pod reads the same file, so a file's num_machines that differs from
PET_NNODES, or its machine_rank that differs from PET_NODE_RANK, would make the pods run separate jobs (or claim one
rank): that is a one-line error, and a flag (--num_machines, --machine_rank) says it is meant.

PyTorchJob (Kubeflow's Training Operator v1) sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK in every pod: RANK is
the pod's index and WORLD_SIZE the number of pods (releases that multiply it by nprocPerNode also set PET_NNODES and
PET_NODE_RANK, which are then read instead). These are node-level values, for `torchrun --nnodes $WORLD_SIZE
--node_rank $RANK`, never process ranks: accel launch takes num_machines = WORLD_SIZE, machine_rank = RANK and the
main address and port from MASTER_ADDR/MASTER_PORT, one process per pod unless num_processes (the total) says more.
Inside a launcher's worker (LOCAL_RANK, TORCHELASTIC_RUN_ID or ACCEL_LAUNCH_CONFIG set: cluster_env's
`launcher_worker`) they are process ranks, and are left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from accel.cli._common import UsageError
from accel.config.errors import shown
from accel.runtime.cluster_env import PET, ClusterEnvError, PetEnv, launcher_worker, read_pet  # the one reading

PYTORCHJOB = "PyTorchJob"
PET_VARIABLES = {"num_machines": "PET_NNODES", "machine_rank": "PET_NODE_RANK", "main_process_ip": "PET_MASTER_ADDR",
                 "main_process_port": "PET_MASTER_PORT"}
POD_VARIABLES = {"num_machines": "WORLD_SIZE", "machine_rank": "RANK", "main_process_ip": "MASTER_ADDR",
                 "main_process_port": "MASTER_PORT"}
NPROC_VARIABLE = "PET_NPROC_PER_NODE"
MUST_AGREE = ("num_machines", "machine_rank")  # a file's value that differs: the pods would not form one job
KEYS = ("num_machines", "num_processes", "machine_rank", "main_process_ip", "main_process_port")


@dataclass
class PodEnv:
    """What the pod's variables gave: `values` (config key -> value) for the keys nothing above them set, `sources`
    (config key -> where from, for --dry_run and accel env), `unused` (a variable and what won over it)."""

    engine: str
    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)


def _text(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    return None if value is None or not value.strip() else value.strip()


def _number(env: Mapping[str, str], name: str, low: int, high: int | None, allowed: str) -> int | None:
    value = _text(env, name)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < low or (high is not None and number > high):
        raise UsageError(f"${name}={shown(value)}: bad value; allowed: {allowed} (or the matching accel launch flag, "
                         "which wins)")
    return number


def _pet(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str], PetEnv | None] | None:
    """PET_* as accel.runtime.cluster_env reads them (the one reading, as under plain python): PET_NNODES as N or N:N;
    PET_NPROC_PER_NODE a number, or torchrun's word (refused in `read` where the count is needed)."""
    try:
        pet = read_pet(env)
    except ClusterEnvError as exc:
        raise UsageError(str(exc)) from None
    if pet is None:
        return None
    found: dict[str, Any] = {"num_machines": pet.nnodes, "machine_rank": pet.node_rank,
                             "main_process_ip": pet.master_addr, "main_process_port": pet.master_port}
    values = {key: value for key, value in found.items() if value is not None}
    return values, {key: PET_VARIABLES[key] for key in values}, pet


def _pytorchjob(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str], PetEnv | None] | None:
    world, rank = _text(env, "WORLD_SIZE"), _text(env, "RANK")
    if world is None and rank is None:
        return None
    if launcher_worker(env):
        return None  # a launcher's worker: process ranks, not pods
    if world is None or rank is None:
        have, missing = ("WORLD_SIZE", "RANK") if rank is None else ("RANK", "WORLD_SIZE")
        raise UsageError(f"${have}={shown(env[have])} is set but ${missing} is not: as PyTorchJob sets them (the "
                         f"number of pods and this pod's index) both are needed; allowed: both, or neither (unset "
                         f"{have}), or --num_machines and --machine_rank")
    size = _number(env, "WORLD_SIZE", 1, None, "the number of pods, a whole number from 1")
    index = _number(env, "RANK", 0, None, "this pod's index, a whole number from 0")
    assert size is not None and index is not None
    if index >= size:
        raise UsageError(f"$RANK={index} with $WORLD_SIZE={size}: a pod index out of range; allowed: 0 to {size - 1} "
                         "(PyTorchJob: RANK is the pod's index, WORLD_SIZE the number of pods)")
    values: dict[str, Any] = {"num_machines": size, "machine_rank": index}
    if _text(env, "MASTER_ADDR"):
        values["main_process_ip"] = _text(env, "MASTER_ADDR")
    port = _number(env, "MASTER_PORT", 1, 65535, "a port number from 1 to 65535")
    if port is not None:
        values["main_process_port"] = port
    return values, {key: POD_VARIABLES[key] for key in values}, None


def read(env: Mapping[str, str], given: Mapping[str, Any], file_values: Mapping[str, Any], file_name: str
         ) -> PodEnv | None:
    """The pod's values for the keys neither `given` (the flags, srun's values) nor `file_values` (the user's config
    file's layer, named `file_name`) set; None outside a pod (no PET_* and no WORLD_SIZE/RANK). One-line errors:
    a bad value, a file that contradicts the pod's node count or rank, WORLD_SIZE without RANK."""
    found = _pet(env)
    engine = PET
    if found is None:
        found, engine = _pytorchjob(env), PYTORCHJOB
    if found is None:
        return None
    raw, names, pet_env = found
    pod = PodEnv(engine)

    def winner(key: str) -> str | None:
        if given.get(key) is not None:
            return f"--{key}"
        if file_values.get(key) is not None:
            return f"{file_name}'s {key}"
        return None

    for key in MUST_AGREE:
        if key in raw and given.get(key) is None and file_values.get(key) is not None and file_values[key] != raw[key]:
            if key == "machine_rank" and raw.get("num_machines", 1) == 1:
                continue
            raise UsageError(f"{file_name} sets {key}: {file_values[key]} but ${names[key]}={raw[key]} ({engine}): the "
                             f"pods read the same file, so they would not form one job; allowed: leave {key} out of "
                             f"the file (the pod's value is taken), or give --{key} to mean it")
    machines = given.get("num_machines") or file_values.get("num_machines") or raw.get("num_machines") or 1
    for key in KEYS:
        if key == "num_processes":
            continue
        if key not in raw:
            continue
        over = winner(key)
        if over is not None:
            pod.unused.append(f"${names[key]}={raw[key]} ({over} wins)")
        elif key != "num_machines" and machines == 1:
            pod.unused.append(f"${names[key]}={raw[key]} (one machine: not needed)")
        else:
            pod.values[key] = raw[key]
            pod.sources[key] = f"${names[key]} ({engine})"
    if machines > 1 and "machine_rank" not in raw and winner("machine_rank") is None:  # PET_* only: RANK is required
        raise UsageError(f"num_machines {machines} but $PET_NODE_RANK is not set ({engine}): every pod would claim "
                         "machine rank 0; allowed: $PET_NODE_RANK set to the pod's index, or --machine_rank")
    over = winner("num_processes")
    nproc = None if pet_env is None else pet_env.nproc
    if pet_env is not None and over is None:  # torchrun's auto/cpu/gpu: the count is needed, and unknown here
        try:
            nproc = pet_env.processes_per_node()
        except ClusterEnvError as exc:
            raise UsageError(str(exc)) from None
    per_node = 1 if not isinstance(nproc, int) else nproc
    if over is not None:
        if nproc is not None:
            pod.unused.append(f"${NPROC_VARIABLE}={nproc} ({over} wins)")
        total = given.get("num_processes") or file_values.get("num_processes")
        if engine == PYTORCHJOB and "num_machines" in pod.values and isinstance(total, int) and total % machines:
            raise UsageError(f"{over} {total} is not a multiple of $WORLD_SIZE={machines} (PyTorchJob: the number of "
                             f"pods); allowed: the total over all pods, a multiple of {machines}, or --num_machines")
    elif nproc is not None or "num_machines" in pod.values:
        pod.values["num_processes"] = per_node * machines
        pod.sources["num_processes"] = (f"${NPROC_VARIABLE} x num_machines ({engine})" if nproc is not None else
                                        f"one process per pod x num_machines ({engine})")
    return pod


def describe(pod: PodEnv | None) -> str | None:
    """One line for `accel env`: the values the pod's variables gave, with their sources, and those that lost."""
    if pod is None:
        return None
    taken = ", ".join(f"{key} {pod.values[key]} from {pod.sources[key].rsplit(' (', 1)[0]}" for key in pod.values)
    line = f"- cluster environment: {pod.engine}: {taken or 'no value taken'}"
    if pod.unused:
        line += "; not used: " + ", ".join(pod.unused)
    return line
