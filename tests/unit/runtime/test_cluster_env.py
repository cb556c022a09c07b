"""What a cluster's scheduler sets, read without starting processes: SLURM's host lists and task variables (`srun`
without a launcher, accel.runtime.cluster_env), Kubeflow Trainer's PET_* and PyTorchJob's WORLD_SIZE/RANK under
`accel launch` (accel/cli/kubeflow.py) with their precedence, and the one-line errors (exit code 2) where they cannot
form one job. The jobs themselves run in tests/multiproc/launching/test_cluster_envs.py."""

from __future__ import annotations

import pytest

from accel.cli import kubeflow
from accel.cli._common import UsageError
from accel.cli.main import main
from accel.runtime.cluster_env import (
    ClusterEnvError,
    derived_port,
    expand_hostlist,
    export_task_env,
    mpi_task_env,
    slurm_task_env,
    task_env,
)

# ----------------------------------------------------------------------------------------------------------
# SLURM: host lists, srun without a launcher
# ----------------------------------------------------------------------------------------------------------

TASK = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4711", "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1", "SLURM_NODELIST": "node[001-002]", "SLURM_JOB_NODELIST": "node[001-003,007],gpu1"}


def test_hostlist_expands_ranges_with_padding_and_plain_names():
    assert expand_hostlist("node[001-003,007],gpu1") == ["node001", "node002", "node003", "node007", "gpu1"]
    assert expand_hostlist("r[1-2]n[8-9]") == ["r1n8", "r1n9", "r2n8", "r2n9"]


def test_srun_task_becomes_torchruns_variables():
    env = slurm_task_env(TASK)
    port = derived_port("4711", "0")
    assert env == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "NODE_RANK": "1", "MASTER_ADDR": "node001",
                   "MASTER_PORT": str(port)}
    assert 15000 <= port < 25000 and derived_port("4711", "1") != port  # another step of the job: another port
    # the step's own list and task count first; a MASTER_ADDR/MASTER_PORT the batch script exported wins
    step = {**TASK, "SLURM_STEP_NODELIST": "gpu[7-8]", "SLURM_STEP_NUM_TASKS": "8", "MASTER_PORT": "12345"}
    assert slurm_task_env(step) == {**env, "WORLD_SIZE": "8", "MASTER_ADDR": "gpu7", "MASTER_PORT": "12345"}
    assert slurm_task_env({**TASK, "MASTER_ADDR": "10.0.0.9"})["MASTER_ADDR"] == "10.0.0.9"
    environ = dict(TASK)
    export_task_env(environ)
    assert environ["RANK"] == "3" and environ["SLURM_PROCID"] == "3"


@pytest.mark.parametrize("change", [
    {"SLURM_STEP_ID": None},  # the batch script itself: SLURM_NTASKS describes the allocation, accel launch may follow
    {"SLURM_NTASKS": "1"},  # one task: a one-process job
    {"LOCAL_RANK": "0"}, {"TORCHELASTIC_RUN_ID": "x"},  # a launcher's worker (srun accel launch, torchrun)
    {"ACCEL_LAUNCH_CONFIG": "{}"},  # started by accel launch
])
def test_srun_variables_are_left_alone_outside_a_launcherless_step(change):
    env = {k: v for k, v in {**TASK, **change}.items() if v is not None}
    assert slurm_task_env(env) is None and task_env(env) is None
    # torchrun's RANK/WORLD_SIZE set without a launcher are compared with SLURM's
    # (tests/unit/runtime/test_cluster_variables.py)


@pytest.mark.parametrize("change, needle", [
    ({"SLURM_NODELIST": None, "SLURM_JOB_NODELIST": None}, r"none of \$SLURM_STEP_NODELIST, .* is set.*MASTER_ADDR"),
    ({"SLURM_NODELIST": "node[1-"}, r"\$SLURM_NODELIST='node\[1-' is not a SLURM host list"),
    ({"SLURM_PROCID": None}, r"\$SLURM_PROCID is unset; allowed: 0 to 3"),
    ({"SLURM_PROCID": "4"}, r"\$SLURM_PROCID=4; allowed: 0 to 3"),
    ({"SLURM_LOCALID": None}, r"\$SLURM_LOCALID is unset"),
    ({"SLURM_NTASKS": "four"}, r"\$SLURM_NTASKS='four' is not an integer"),
    ({"SLURM_JOB_ID": None}, r"\$SLURM_JOB_ID is unset, so no port can be derived.*MASTER_PORT"),
])
def test_srun_step_that_cannot_form_a_group_is_one_line(change, needle):
    env = {k: v for k, v in {**TASK, **change}.items() if v is not None}
    with pytest.raises(ClusterEnvError, match=needle) as err:
        slurm_task_env(env)
    assert "srun step of 4 tasks" in str(err.value) or "not an integer" in str(err.value)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------------------------------------
# Kubeflow Trainer (PET_*) and PyTorchJob (WORLD_SIZE/RANK) under accel launch
# ----------------------------------------------------------------------------------------------------------

PET = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-node-0-0.job",
       "PET_MASTER_PORT": "29500"}


def test_pet_variables_give_the_job_shape():
    pod = kubeflow.read(PET, {}, {}, "f.yaml")
    assert pod.values == {"num_machines": 2, "machine_rank": 1, "main_process_ip": "job-node-0-0.job",
                          "main_process_port": 29500, "num_processes": 8}
    assert pod.sources["num_machines"] == "$PET_NNODES (Kubeflow Trainer)"
    one = kubeflow.read({"PET_NPROC_PER_NODE": "2", "PET_MASTER_PORT": "29500"}, {}, {}, "f.yaml")
    assert one.values == {"num_processes": 2}  # one machine: rendezvous on 127.0.0.1 on a free port, as ever
    assert kubeflow.read({}, {}, {}, "f.yaml") is None


def test_precedence_flags_then_file_then_pet_then_defaults():
    pod = kubeflow.read(PET, {"num_processes": 2, "main_process_port": 1234}, {"main_process_ip": "10.0.0.1"},
                        "f.yaml")
    assert pod.values == {"num_machines": 2, "machine_rank": 1}
    assert "$PET_MASTER_PORT=29500 (--main_process_port wins)" in pod.unused
    assert "$PET_MASTER_ADDR=job-node-0-0.job (f.yaml's main_process_ip wins)" in pod.unused
    # the file's num_processes (the total) wins over PET_NPROC_PER_NODE; num_machines agrees with PET_NNODES
    pod = kubeflow.read(PET, {}, {"num_processes": 4, "num_machines": 2}, "f.yaml")
    assert "num_processes" not in pod.values and pod.values["machine_rank"] == 1
    # a flag's num_machines wins (meant); the per-process count then follows it
    pod = kubeflow.read(PET, {"num_machines": 1}, {}, "f.yaml")
    assert pod.values == {"num_processes": 4}
    assert kubeflow.describe(pod).startswith("- cluster environment: Kubeflow Trainer: num_processes 4 from ")


@pytest.mark.parametrize("env, file, needle", [
    (PET, {"num_machines": 1}, r"f.yaml sets num_machines: 1 but \$PET_NNODES=2 \(Kubeflow Trainer\): .*--num_"),
    (PET, {"num_machines": 2, "machine_rank": 0}, r"f.yaml sets machine_rank: 0 but \$PET_NODE_RANK=1"),
    ({**PET, "PET_NPROC_PER_NODE": "auto"}, {}, r"\$PET_NPROC_PER_NODE='auto': bad value; allowed: a whole number"),
    ({**PET, "PET_NNODES": "1:4"}, {}, r"\$PET_NNODES='1:4': an elastic range of nodes"),
    ({**PET, "PET_MASTER_PORT": "0"}, {}, r"\$PET_MASTER_PORT='0': bad value; allowed: a port number from 1 to 65535"),
    ({"PET_NNODES": "2", "PET_MASTER_ADDR": "a"}, {}, r"num_machines 2 but \$PET_NODE_RANK is not set"),
    ({"WORLD_SIZE": "2"}, {}, r"\$WORLD_SIZE='2' is set but \$RANK is not"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, {}, r"\$RANK=2 with \$WORLD_SIZE=2: a pod index out of range"),
])
def test_pod_values_that_cannot_form_one_job_are_one_line(env, file, needle):
    with pytest.raises(UsageError, match=needle) as err:
        kubeflow.read(env, {}, file, "f.yaml")
    assert "\n" not in str(err.value)


def test_pytorchjob_world_size_and_rank_are_pods_not_processes():
    pod_env = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    pod = kubeflow.read(pod_env, {"num_processes": 8}, {}, "f.yaml")
    assert pod.values == {"num_machines": 2, "machine_rank": 1, "main_process_ip": "job-master-0",
                          "main_process_port": 23456}  # 8 in total: 4 per pod
    assert kubeflow.read(pod_env, {}, {}, "f.yaml").values["num_processes"] == 2  # one per pod, as torchrun's default
    with pytest.raises(UsageError, match=r"--num_processes 3 is not a multiple of \$WORLD_SIZE=2 \(PyTorchJob"):
        kubeflow.read(pod_env, {"num_processes": 3}, {}, "f.yaml")
    # newer operators set PET_* too (WORLD_SIZE is then pods x nprocPerNode): PET_* are read
    both = kubeflow.read({**pod_env, "WORLD_SIZE": "8", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "4",
                          "PET_NODE_RANK": "1"}, {}, {}, "f.yaml")
    assert both.engine == kubeflow.PET and both.values["num_processes"] == 8
    # inside a launcher's worker they are process ranks: left alone
    assert kubeflow.read({**pod_env, "LOCAL_RANK": "0"}, {}, {}, "f.yaml") is None


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in (*PET, "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                 "ACCEL_CONFIG_FILE", "SLURM_STEP_ID", "SLURM_STEPID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    return monkeypatch, script


@pytest.mark.parametrize("env, flags, wanted", [
    (PET, [], ["num_processes: 8  # $PET_NPROC_PER_NODE x num_machines (Kubeflow Trainer)",
               "machine_rank: 1  # $PET_NODE_RANK (Kubeflow Trainer)", "--nnodes 2 --nproc_per_node 4",
               "--node_rank 1 --master_addr job-node-0-0.job --master_port 29500"]),
    # PyTorchJob: one pod running 2 processes; two pods of 2 processes each (4 in total)
    ({"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "23456"}, ["--num_processes", "2"],
     ["num_machines: 1  # $WORLD_SIZE (PyTorchJob)", "--nnodes 1 --nproc_per_node 2", "--rdzv_endpoint 127.0.0.1:0"]),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}, ["--num_processes", "4"],
     ["num_machines: 2  # $WORLD_SIZE (PyTorchJob)", "--nnodes 2 --nproc_per_node 2",
      "--node_rank 1 --master_addr job-master-0 --master_port 23456"]),
])
def test_dry_run_shows_the_pods_values_and_their_sources(clean_env, capsys, env, flags, wanted):
    monkeypatch, script = clean_env
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["launch", "--cpu", "--dry_run", *flags, str(script)]) == 0
    out = capsys.readouterr().out
    for needle in wanted:
        assert needle in out, out


def test_ambiguous_pod_is_one_line_and_exit_code_2(clean_env, capsys):
    monkeypatch, script = clean_env
    monkeypatch.setenv("RANK", "1")
    assert main(["launch", "--cpu", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("accel launch: error: $RANK='1' is set but $WORLD_SIZE is not") and err.count("\n") == 1
    (script.parent / "c.yaml").write_text("num_machines: 1\nnum_processes: 1\n")  # as `accel config` writes
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["env", "--cpu", "--config_file", str(script.parent / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert "sets num_machines: 1 but $WORLD_SIZE=4 (PyTorchJob)" in err and err.count("\n") == 1


def test_srun_of_several_tasks_on_one_node_into_accel_launch_is_refused():
    from accel.cli.multinode import slurm_overrides

    step = {"SLURM_STEP_ID": "0", "SLURM_NNODES": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}
    with pytest.raises(UsageError, match=r"SLURM started 2 tasks on one node \(\$SLURM_NTASKS\); .*per-node=1"):
        slurm_overrides(step, {})
    assert slurm_overrides({**step, "SLURM_NTASKS": "1"}, {}) == {}


def test_accel_env_says_which_pod_values_were_taken_and_which_lost(clean_env, capsys):
    monkeypatch, script = clean_env
    config = script.parent / "c.yaml"
    config.write_text("num_processes: 1\n")
    monkeypatch.setenv("PET_NNODES", "1")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "2")
    assert main(["env", "--cpu", "--config_file", str(config)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("- cluster environment"))
    assert line == (f"- cluster environment: Kubeflow Trainer: num_machines 1 from $PET_NNODES; not used: "
                    f"$PET_NPROC_PER_NODE=2 ({config}'s num_processes wins)")


@pytest.mark.parametrize("cpu", [False, True])
def test_accelerate_torch_device_names_the_device_as_in_accelerate(monkeypatch, cpu):
    """Ray Train sets ACCELERATE_TORCH_DEVICE to each worker's device; Accelerate's PartialState takes it, even over
    cpu=True (its own unit test sets cuda:64 with torch.cuda.set_device patched out)."""
    import torch

    from accel import Accelerator
    from accel.state import PartialState

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cuda:64")
    PartialState._reset_state()
    try:
        accelerator = Accelerator(cpu=cpu)
        assert str(accelerator.state.device) == str(accelerator.device) == "cuda:64"
        assert [str(device) for device in calls] == ["cuda:64"]  # made current, as NCCL needs
    finally:
        PartialState._reset_state()


def _partial_state_refuses(error: type, pattern: str) -> None:
    """PartialState() of this environment raises `error` matching `pattern` (the state reset before and after)."""
    from accel.state import PartialState

    PartialState._reset_state()
    try:
        with pytest.raises(error, match=pattern):
            PartialState()
    finally:
        PartialState._reset_state()


def test_a_bad_accelerate_torch_device_is_one_line(monkeypatch):
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "gpu0")
    _partial_state_refuses(ValueError, r"^environment variable ACCELERATE_TORCH_DEVICE='gpu0' is not a torch device; "
                                       r"allowed: a device string such as cpu, cuda, cuda:1$")



# ----------------------------------------------------------------------------------------------------------
# mpirun without a launcher (Open MPI, MPICH/Intel MPI's Hydra, MVAPICH2)
# ----------------------------------------------------------------------------------------------------------

OPEN_MPI = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
HYDRA = {"PMI_SIZE": "2", "PMI_RANK": "1", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
MVAPICH = {"MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_LOCAL_RANK": "0",
           "MV2_COMM_WORLD_LOCAL_SIZE": "2"}


@pytest.mark.parametrize("env, wanted", [
    # one machine: rank 0 is here
    (HYDRA, {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": "29500"}),
    (MVAPICH, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": "29500"}),
    # two machines: MASTER_ADDR exported by the user (mpirun -x MASTER_ADDR); a PMIx namespace derives the port
    ({**OPEN_MPI, "MASTER_ADDR": "node1", "PMIX_NAMESPACE": "prterun-node1-4242@1"},
     {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node1",
      "MASTER_PORT": str(derived_port("prterun-node1-4242@1", "mpi"))}),
    ({**HYDRA, "MASTER_PORT": "1234", "MPI_LOCALRANKID": ""}, None),  # (an empty value is unset: see below)
])
def test_mpirun_processes_become_torchruns_variables(env, wanted):
    if wanted is None:
        with pytest.raises(ClusterEnvError, match=r"^mpirun of 2 processes \(\$PMI_SIZE, MPICH/Intel MPI\) "):
            mpi_task_env({**env, "MPI_LOCALNRANKS": "1"})
        assert mpi_task_env(env)["LOCAL_RANK"] == "1"  # one machine: the local rank is the rank
        return
    assert mpi_task_env(env) == wanted


@pytest.mark.parametrize("env", [
    {"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"},  # one process: nothing to form
    {**OPEN_MPI, "LOCAL_RANK": "1", "RANK": "3"},  # a launcher already set torchrun's variables
    {**OPEN_MPI, "ACCEL_LAUNCH_CONFIG": "{}"},  # a worker of accel launch
    {},
])
def test_mpirun_variables_are_left_alone_where_they_do_not_apply(env):
    assert mpi_task_env(env) is None and task_env(env) is None


@pytest.mark.parametrize("change, needle", [
    ({"OMPI_COMM_WORLD_RANK": "4"}, r"\$OMPI_COMM_WORLD_RANK=4; allowed: 0 to 3"),
    ({"OMPI_COMM_WORLD_RANK": "x"}, r"\$OMPI_COMM_WORLD_RANK='x' is not an integer; allowed: 0 to 3"),
    ({}, r"\$OMPI_COMM_WORLD_LOCAL_SIZE=2 \(of 4\), so rank 0 may be on another machine .*export MASTER_ADDR"),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": ""}, r"\$OMPI_COMM_WORLD_LOCAL_SIZE is unset, so rank 0 may be on another machine"),
])
def test_mpirun_processes_that_cannot_form_a_group_are_one_line(change, needle):
    with pytest.raises(ClusterEnvError, match=needle) as info:
        mpi_task_env({**OPEN_MPI, **change})
    assert "\n" not in str(info.value)


def test_mpirun_of_several_accel_launchers_is_refused(clean_env, capsys):
    from accel.cli.multinode import refuse_mpi_launchers

    monkeypatch, script = clean_env
    for name, value in OPEN_MPI.items():
        monkeypatch.setenv(name, value)
    assert main(["launch", "--cpu", "--dry_run", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("accel launch: error: Open MPI's mpirun started 4 processes ($OMPI_COMM_WORLD_SIZE) and each "
                          "accel launch would start a job of its own") and err.count("\n") == 1
    refuse_mpi_launchers(OPEN_MPI, {"machine_rank": 1})  # one launcher per machine, its rank given: allowed
    refuse_mpi_launchers({"PMI_SIZE": "1"}, {})


def test_a_trainjob_pod_without_a_launcher_is_one_line(monkeypatch):
    """A TrainJob whose command is `python train.py`: PET_NPROC_PER_NODE=2 asks torchrun for 2 processes, but none
    starts them; before, the pod trained alone (1 process) without a word."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ACCEL_LAUNCH_CONFIG", "SLURM_STEP_ID", "SLURM_STEPID",
                 "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PET_NNODES", "1")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "2")
    _partial_state_refuses(ClusterEnvError, r"^\$PET_NPROC_PER_NODE=2 \(Kubeflow Trainer\) asks for several "
                                            r"processes, .*`accel launch train.py`")
    assert task_env({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "1"}) is None  # one process: nothing to start
    assert task_env({"PET_NNODES": "2", "RANK": "0", "LOCAL_RANK": "0"}) is None  # torchrun's (or accel launch's) worker
    # a PyTorchJob pod of one process: its WORLD_SIZE/RANK count pods (PET_NPROC_PER_NODE=auto, the operator's default)
    assert task_env({"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "auto", "WORLD_SIZE": "2",
                     "RANK": "1"}) is None
    # torchrun's word without torchrun: the same line as under accel launch
    # (tests/unit/runtime/test_cluster_variables.py)
    with pytest.raises(ClusterEnvError, match=r"^\$PET_NPROC_PER_NODE='auto': bad value; allowed: a whole number"):
        task_env({"PET_NPROC_PER_NODE": "auto"})
