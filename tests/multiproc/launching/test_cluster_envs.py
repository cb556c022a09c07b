"""Each cluster engine's way of starting a job, simulated on 2 local processes with only what that engine sets (and
`mpirun` of 2 processes without a launcher, Open MPI's and Hydra's variables):
`srun` of 2 tasks without a launcher (SLURM's task variables), a Kubeflow Trainer pod (PET_NPROC_PER_NODE=2 under
`accel launch`), two PyTorchJob pods (their WORLD_SIZE/RANK/MASTER_* under `accel launch --num_processes 2`).
Every process must see one job of 2. Without that, srun gave two 1-process jobs, PET_NPROC_PER_NODE=2
started one process, and each PyTorchJob pod ran its own job of 2. The pure parts and the one-line errors:
tests/unit/runtime/test_cluster_env.py."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import warm_python
from _launch import ROOT, accel_launch

pytestmark = pytest.mark.multiproc

# builds an Accelerator from the environment alone and proves the processes are one group
PROBE = """import sys

import torch
from accel import Accelerator

accelerator = Accelerator()
total = accelerator.reduce(torch.tensor([accelerator.process_index + 1.0], device=accelerator.device), "sum")
ranks = accelerator.gather(torch.tensor([accelerator.process_index], device=accelerator.device))
line = (f"PROBE index={accelerator.process_index} num={accelerator.num_processes} "
        f"local={accelerator.local_process_index} sum={total.item():g} ranks={ranks.tolist()}\\n")
sys.stdout.write(line.replace(", ", ","))  # one write: the two processes share the pipe
sys.stdout.flush()
"""
LINE = re.compile(r"PROBE index=(\d+) num=(\d+) local=(\d+) sum=(\S+) ranks=(\[[\d,]*\])")


def probes(text: str) -> dict[int, tuple[int, int, str, str]]:
    """index -> (num_processes, local index, the all-reduced sum, the gathered ranks), one per process."""
    found = {}
    for match in LINE.finditer(text):
        index, num, local, total, ranks = match.groups()
        assert int(index) not in found, text
        found[int(index)] = (int(num), int(local), total, ranks)
    return found


def one_job_of_two(text: str, locals_: tuple[int, int] = (0, 1)) -> None:
    assert probes(text) == {0: (2, locals_[0], "3", "[0,1]"), 1: (2, locals_[1], "3", "[0,1]")}, text


@pytest.fixture
def probe(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


def _slurm_job_id_with_free_port(free_port: int) -> int:
    """A job id (from `free_port` on) whose derived port (accel.runtime.cluster_env.derived_port, step 0) is free
    now: the tasks meet on the port srun's job id gives, as on a cluster."""
    from accel.cli.launch import port_in_use
    from accel.runtime.cluster_env import derived_port

    for job in range(free_port, free_port + 200):
        if not port_in_use(derived_port(str(job), "0")):
            return job
    pytest.skip("no free port among the derived ones")


def run_together(jobs: list[tuple[list[str], dict]]) -> list[str]:
    """Start each (command, environment) at once, as the engine starts its tasks or pods; all must exit 0. Their
    outputs (stdout and stderr)."""
    procs = [warm_python.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for cmd, env in jobs]
    try:
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [0] * len(procs), outputs
    return outputs


def test_srun_without_a_launcher_forms_one_group(isolated_env, probe, free_port):
    """`srun --ntasks=2 python probe.py` on one node: SLURM's variables only, no RANK/WORLD_SIZE/MASTER_*."""
    job = _slurm_job_id_with_free_port(free_port)
    base = {**isolated_env, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": str(job), "SLURM_JOBID": str(job),
            "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_NTASKS": "2", "SLURM_NPROCS": "2",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost",
            "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_NODELIST": "localhost"}
    outputs = run_together([([sys.executable, str(probe)], {**base, "SLURM_PROCID": str(task),
                                                             "SLURM_LOCALID": str(task)}) for task in (0, 1)])
    one_job_of_two("".join(outputs))


def test_kubeflow_trainer_pod_starts_pet_nproc_per_node_processes(isolated_env, probe):
    result = accel_launch({**isolated_env, "PET_NPROC_PER_NODE": "2", "PET_NNODES": "1", "PET_NODE_RANK": "0"},
                          "--cpu", probe, timeout=120)
    one_job_of_two(result.stdout)


def test_pytorchjob_pods_world_size_and_rank_are_node_level(isolated_env, probe, free_port):
    """Two pods (WORLD_SIZE=2 pods, RANK = the pod's index), `accel launch --num_processes 2` in each: one job of 2,
    one process per pod. Before the fix each pod ran its own 2-process job (4 processes, two jobs)."""
    cmd = [sys.executable, "-m", "accel.cli.main", "launch", "--cpu", "--num_processes", "2", str(probe)]
    pods = [{"WORLD_SIZE": "2", "RANK": str(index), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port)}
            for index in (0, 1)]
    outputs = run_together([(cmd, {**isolated_env, "OMP_NUM_THREADS": "1", **pod}) for pod in pods])
    one_job_of_two("".join(outputs), locals_=(0, 0))


@pytest.mark.parametrize("family", ["openmpi", "hydra"])
def test_mpirun_without_a_launcher_forms_one_group(isolated_env, probe, free_port, family):
    """`mpirun -np 2 python probe.py` on one machine: MPI's variables only (Open MPI's, or MPICH/Intel MPI's Hydra),
    and the port exported as `mpirun -x MASTER_PORT` would. Before, two 1-process jobs."""
    names = {"openmpi": ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                         "OMPI_COMM_WORLD_LOCAL_SIZE"),
             "hydra": ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")}[family]
    base = {**isolated_env, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port)}
    outputs = run_together([([sys.executable, str(probe)], {**base, **dict(zip(names, ("2", str(rank), str(rank), "2"),
                                                                                strict=True))}) for rank in (0, 1)])
    one_job_of_two("".join(outputs))
