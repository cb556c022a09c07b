"""Every scheduler's variables read once, alike under `accel launch` and under a plain `python train.py`
(accel.runtime.cluster_env):

* Kubeflow's forms: PET_NNODES=N:N (what Kubeflow writes for an elastic policy of fixed size) and torchrun's
  PET_NPROC_PER_NODE=auto read, or are refused, with the same line under both; before, plain python trained alone.
* Every scheduler against every other (SLURM, Open MPI, MPICH/Intel MPI, MVAPICH2, torchrun's RANK/WORLD_SIZE set
  without a launcher, Kubeflow's PET_*): two that disagree on the rank or the number of processes are one line
  naming both variables and values; agreeing ones form one job. Before, SLURM's won unchecked (two rank 0s).
* SLURM host lists are parsed whole but expanded lazily: `node[0-99999999]` gives its first host at once (before,
  --dry_run grew to 9.5 GB), and a list is listed whole only up to a bound.
* Under plain python a refusal is its one line alone, no traceback (two subprocesses)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tracemalloc

import pytest

from accel.cli import kubeflow
from accel.cli._common import UsageError
from accel.cli.main import main
from accel.cli.multinode import slurm_overrides
from accel.runtime.cluster_env import (
    MAX_HOSTS,
    ClusterEnvError,
    expand_hostlist,
    first_host,
    iter_hostlist,
    parse_hostlist,
    slurm_task_env,
    task_env,
)

# ----------------------------------------------------------------------------------------------------------
# each scheduler's variables for this process: (world size, rank) -> env; the names each uses for them
# ----------------------------------------------------------------------------------------------------------


def slurm(size: int, rank: int) -> dict[str, str]:
    return {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4711", "SLURM_NTASKS": str(size), "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "node[07-08]"}


def mpi(names: tuple[str, str, str, str]):
    def env(size: int, rank: int) -> dict[str, str]:
        return dict(zip(names, (str(size), str(rank), str(rank), str(size)), strict=True))
    return env


def torchrun(size: int, rank: int) -> dict[str, str]:  # set by hand or by an operator, not by a launcher
    return {"WORLD_SIZE": str(size), "RANK": str(rank)}


def pet(size: int, rank: int) -> dict[str, str]:  # one process per node: the node's rank is the process's
    return {"PET_NNODES": str(size), "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(rank)}


SCHEDULERS = {  # name -> (env of (size, rank), its size variable, its rank variable)
    "SLURM": (slurm, "SLURM_NTASKS", "SLURM_PROCID"),
    "Open MPI": (mpi(("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                      "OMPI_COMM_WORLD_LOCAL_SIZE")), "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    "MPICH/Intel MPI": (mpi(("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")), "PMI_SIZE", "PMI_RANK"),
    "MVAPICH2": (mpi(("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
                      "MV2_COMM_WORLD_LOCAL_SIZE")), "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"),
    "torchrun's": (torchrun, "WORLD_SIZE", "RANK"),
    "Kubeflow Trainer": (pet, "PET_NNODES", "PET_NODE_RANK"),
}
PAIRS = list(itertools.combinations(SCHEDULERS, 2))


@pytest.mark.parametrize("first, second", PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
def test_two_schedulers_that_disagree_are_one_line_naming_both(first, second):
    (env_a, size_a, rank_a), (env_b, size_b, rank_b) = SCHEDULERS[first], SCHEDULERS[second]
    with pytest.raises(ClusterEnvError) as err:  # the probe: SLURM_PROCID=0 on both tasks, MPI's 0 and 1
        task_env({**env_a(2, 0), **env_b(2, 1)})
    message = str(err.value)
    assert f"${rank_a}=0" in message and f"${rank_b}=1" in message and "disagree on this process's rank" in message
    assert "\n" not in message and "allowed: " in message
    with pytest.raises(ClusterEnvError) as err:
        task_env({**env_a(2, 1), **env_b(4, 1)})
    message = str(err.value)
    assert f"${size_a}=2" in message and f"${size_b}=4" in message and "disagree on the number of processes" in message
    # when they agree: one job of 2, formed from SLURM's variables, else MPI's (a PyTorchJob pod, torchrun's and
    # PET_* of one process per pod: nothing to set, WORLD_SIZE and RANK are there already)
    found = task_env({**env_a(2, 1), **env_b(2, 1)})
    if {first, second} == {"torchrun's", "Kubeflow Trainer"}:
        assert found is None
    else:
        assert found is not None and (found["RANK"], found["WORLD_SIZE"]) == ("1", "2")


def test_agreeing_schedulers_form_slurms_job_with_its_address_and_local_rank():
    env = {**slurm(2, 1), **SCHEDULERS["Open MPI"][0](2, 1), "WORLD_SIZE": "2"}  # srun --mpi=pmix; WORLD_SIZE by hand
    assert task_env(env) == {**slurm_task_env(env), "MASTER_ADDR": "node07", "LOCAL_RANK": "1"}
    # a stale RANK=0 WORLD_SIZE=1 in the shell under `srun -n 4`: before, each task trained alone
    with pytest.raises(ClusterEnvError, match=r"^\$WORLD_SIZE=1 \(torchrun's variable, set without a launcher\) and "
                                              r"\$SLURM_NTASKS=4 \(SLURM\) disagree on the number of processes"):
        task_env({**slurm(4, 2), "WORLD_SIZE": "1", "RANK": "0"})
    # a SLURM step or an MPI world of one (a launcher inside it starts the processes) says nothing about them
    assert task_env({**slurm(1, 0), **SCHEDULERS["Open MPI"][0](2, 1)})["RANK"] == "1"


# ----------------------------------------------------------------------------------------------------------
# Kubeflow's forms: read, or refused, alike under accel launch and plain python
# ----------------------------------------------------------------------------------------------------------

POD = {"PET_NNODES": "2:2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-node-0-0.job",
       "PET_MASTER_PORT": "29500"}


def test_pet_nnodes_n_colon_n_reads_as_n_under_both():
    assert kubeflow.read(POD, {}, {}, "f.yaml").values["num_machines"] == 2  # accel launch (as before)
    with pytest.raises(ClusterEnvError, match=r"^\$PET_NNODES=2:2 \(Kubeflow Trainer\) asks for several processes, "
                                              r"but this one was started without a launcher"):
        task_env(POD)  # plain python: before, this pod trained alone (WORLD 0/1, exit 0)
    assert task_env({**POD, "PET_NNODES": "1:1"}) is None  # one process: nothing to start
    assert kubeflow.read({**POD, "PET_NNODES": " 3 : 3 "}, {}, {}, "f.yaml").values["num_machines"] == 3


@pytest.mark.parametrize("name, value, allowed", [
    ("PET_NNODES", "abc", "a whole number of nodes from 1, or MIN:MAX with MIN equal to MAX"),
    ("PET_NNODES", "3:2", "a whole number of nodes from 1, or MIN:MAX with MIN equal to MAX"),
    ("PET_NNODES", "0", "a whole number of nodes from 1"),
    ("PET_NNODES", "2:", "a whole number of nodes from 1"),
    ("PET_NNODES", "1:4", "a fixed number of nodes, N or N:N"),  # a real elastic range
    ("PET_NPROC_PER_NODE", "auto", "a whole number of processes per node from 1 to 4096"),
    ("PET_NPROC_PER_NODE", "gpu", "a whole number of processes per node"),
    ("PET_NPROC_PER_NODE", "0", "a whole number of processes per node"),
    ("PET_NPROC_PER_NODE", "٣", "a whole number of processes per node"),  # a digit, but not an ASCII one
    ("PET_NODE_RANK", "-1", "this node's rank, a whole number from 0"),
    ("PET_MASTER_PORT", "70000", "a port number from 1 to 65535"),
])
def test_a_bad_pet_value_is_the_same_line_under_both(name, value, allowed):
    env = {**POD, name: value}
    with pytest.raises(UsageError) as launched:
        kubeflow.read(env, {}, {}, "f.yaml")
    with pytest.raises(ClusterEnvError) as plain:
        task_env(env)
    assert str(plain.value) == str(launched.value), (plain.value, launched.value)
    line = str(plain.value)
    assert line.startswith(f"${name}='{value}': ") and f"allowed: {allowed}" in line and "\n" not in line


def test_torchruns_word_where_no_count_is_needed():
    # a PyTorchJob pod (the operator's default nprocPerNode is auto, and it then counts 1 process per pod in
    # WORLD_SIZE) running python train.py: one process per pod, as before
    pytorchjob = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": "1", "WORLD_SIZE": "2", "RANK": "1",
                  "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    assert task_env(pytorchjob) is None
    # ... but 4 processes per pod (WORLD_SIZE = pods x 4, RANK the pod's index) need a launcher
    with pytest.raises(ClusterEnvError, match=r"^\$PET_NPROC_PER_NODE=4 \(Kubeflow Trainer\) asks for several"):
        task_env({**pytorchjob, "PET_NPROC_PER_NODE": "4", "WORLD_SIZE": "8"})
    # accel launch with the total given: the word is not needed (before: refused all the same)
    pod = kubeflow.read(pytorchjob, {"num_processes": 8}, {}, "f.yaml")
    assert pod.values["num_machines"] == 2 and "$PET_NPROC_PER_NODE=auto (--num_processes wins)" in pod.unused


# ----------------------------------------------------------------------------------------------------------
# accel launch: the machine counts and ranks of SLURM, PET_* and MPI against each other
# ----------------------------------------------------------------------------------------------------------

SRUN = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "77", "SLURM_NNODES": "4", "SLURM_NTASKS": "4", "SLURM_PROCID": "2",
        "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "node[01-04]"}


def test_launcher_schedulers_that_disagree_on_machines_are_one_line():
    with pytest.raises(UsageError, match=r"^\$SLURM_NNODES=4 \(SLURM\) and \$PET_NNODES=2 \(Kubeflow Trainer\) "
                                         r"disagree on the number of machines.*--num_machines"):
        slurm_overrides({**SRUN, "PET_NNODES": "2", "PET_NODE_RANK": "2"}, {})
    with pytest.raises(UsageError, match=r"^\$SLURM_PROCID=2 \(SLURM\) and \$PET_NODE_RANK=0 \(Kubeflow Trainer\) "
                                         r"disagree on this machine's rank"):
        slurm_overrides({**SRUN, "PET_NNODES": "4:4", "PET_NODE_RANK": "0"}, {})
    # agreeing, or settled by the flags (which win): as before
    assert slurm_overrides({**SRUN, "PET_NNODES": "4", "PET_NODE_RANK": "2"}, {})["machine_rank"] == 2
    assert slurm_overrides({**SRUN, "PET_NNODES": "2", "PET_NODE_RANK": "0"},
                           {"num_machines": 4, "machine_rank": 2}) == {"main_process_ip": "node01"}


# ----------------------------------------------------------------------------------------------------------
# SLURM's host lists: the first host at once, a list listed whole only up to a bound
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "PET_", "OMPI_", "PMI_", "MV2_", "ACCEL_")) or name in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    return monkeypatch, script


def test_a_host_list_of_millions_gives_its_first_host_without_expanding(clean_env, capsys):
    step = {**slurm(2, 1), "SLURM_STEP_NODELIST": "node[0-999999]"}
    tracemalloc.start()
    try:
        assert slurm_task_env(step)["MASTER_ADDR"] == "node0"
        assert slurm_overrides({**SRUN, "SLURM_JOB_NODELIST": "node[0-999999]"}, {})["main_process_ip"] == "node0"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak  # before: the million names were listed (some 70 MB) for the first one
    # the probe: `accel launch --dry_run` under srun with SLURM_STEP_NODELIST=node[0-99999999]
    monkeypatch, script = clean_env
    for name, value in {**SRUN, "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
                        "SLURM_STEP_NODELIST": "node[0-99999999]"}.items():
        monkeypatch.setenv(name, value)
    assert main(["launch", "--cpu", "--dry_run", "--num_processes", "2", str(script)]) == 0
    assert "--node_rank 1 --master_addr node0 " in capsys.readouterr().out


def test_host_lists_are_expanded_lazily_and_whole_only_up_to_the_bound():
    assert first_host("r[1-99999999]n[1-99999999]-ib,login") == "r1n1-ib"
    assert list(itertools.islice(iter_hostlist("r[1-99999999]n[08-10,3]"), 5)) == ["r1n08", "r1n09", "r1n10", "r1n3",
                                                                                    "r2n08"]
    assert parse_hostlist("node[0-99999999],login[1-2]").count == 100_000_002
    with pytest.raises(ValueError, match=rf"^it names more than {MAX_HOSTS:,} hosts"):
        expand_hostlist("node[0-99999999]")
    assert expand_hostlist("node[1-3]", limit=3) == ["node1", "node2", "node3"]
    with pytest.raises(ValueError, match="more than 2 hosts"):
        expand_hostlist("node[1-3]", limit=2)
    assert first_host("a[1]" * 5000) == "a1" * 5000  # thousands of bracket groups: no recursion
    # malformed anywhere is malformed, even past the first host; a long bad value is shown shortened, on one line
    with pytest.raises(ClusterEnvError, match=r"^srun step of 2 tasks .*: \$SLURM_STEP_NODELIST='node1,n\[x+\.\.\.x+\]' "
                                              r"is not a SLURM host list \(bad range .*\); allowed: e\.g\. node"):
        slurm_task_env({**slurm(2, 0), "SLURM_STEP_NODELIST": "node1,n[" + "x" * 100_000 + "]"})


# ----------------------------------------------------------------------------------------------------------
# plain python: the refusal is the one line alone
# ----------------------------------------------------------------------------------------------------------

PROBE = ("import datetime\nfrom accel.state import PartialState\n"
         "state = PartialState(timeout=datetime.timedelta(seconds=5))\n"
         "print(f'WORLD {state.process_index}/{state.num_processes}')\n")


@pytest.mark.parametrize("env, line", [
    (POD, "accel: error: $PET_NNODES=2:2 (Kubeflow Trainer) asks for several processes, but this one was started "
          "without a launcher and would train alone; allowed: the TrainJob's command `accel launch train.py` (or "
          "torchrun), which starts them"),
    ({**slurm(2, 0), **SCHEDULERS["Open MPI"][0](2, 1)},
     "accel: error: $SLURM_PROCID=0 (SLURM) and $OMPI_COMM_WORLD_RANK=1 (Open MPI) disagree on this process's rank, "
     "so two processes would take one rank; allowed: the variables of the one scheduler that started the processes "
     "(unset the other's), or values that agree"),
], ids=["pet-2:2", "slurm-vs-openmpi"])
def test_plain_python_refusal_is_the_one_line_alone(tmp_path, env, line):
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**base, "OMP_NUM_THREADS": "1", **env})
    assert (result.returncode, result.stdout, result.stderr) == (1, "", line + "\n")
