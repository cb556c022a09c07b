"""examples/clusters: each engine's job file, parsed, and its command run as `accel launch --dry_run` (as a CPU job)
with the variables the engine sets in a pod (issue 43): the job it would start is the one the file describes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from accel.cli.main import main

FOLDER = Path(__file__).resolve().parents[2] / "examples" / "clusters"
POD_VARIABLES = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
                 "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                 "ACCEL_CONFIG_FILE", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_PROCID", "SLURM_NTASKS")


@pytest.fixture
def pod(monkeypatch, tmp_path):
    for name in POD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "train.py").write_text("pass\n")
    monkeypatch.chdir(tmp_path)
    return monkeypatch


def dry_run(command: list[str], capsys) -> str:
    assert command[:2] == ["accel", "launch"], command
    assert main(["launch", "--cpu", "--dry_run", *command[2:]]) == 0
    return capsys.readouterr().out


def test_trainjob_starts_num_nodes_times_num_proc_per_node(pod, capsys):
    job = yaml.safe_load((FOLDER / "trainjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    trainer = job["spec"]["trainer"]
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    # what the torch runtime sets in the second node's pod
    for name, value in {"PET_NNODES": trainer["numNodes"], "PET_NPROC_PER_NODE": trainer["numProcPerNode"],
                        "PET_NODE_RANK": 1, "PET_MASTER_ADDR": "accel-train-node-0-0.accel-train",
                        "PET_MASTER_PORT": 29400}.items():
        pod.setenv(name, str(value))
    out = dry_run(trainer["command"], capsys)
    assert f"--nnodes {trainer['numNodes']} --nproc_per_node {trainer['numProcPerNode']}" in out, out
    assert "--node_rank 1 --master_addr accel-train-node-0-0.accel-train --master_port 29400" in out, out


def test_pytorchjob_pods_are_machines_and_num_processes_the_total(pod, capsys):
    job = yaml.safe_load((FOLDER / "pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    pods = sum(spec["replicas"] for spec in replicas.values())
    commands = {role: spec["template"]["spec"]["containers"][0]["command"] for role, spec in replicas.items()}
    assert set(replicas) == {"Master", "Worker"} and len({tuple(c) for c in commands.values()}) == 1
    # what the operator sets in the worker's pod: WORLD_SIZE = pods, RANK = the pod's index
    for name, value in {"WORLD_SIZE": pods, "RANK": 1, "MASTER_ADDR": "accel-train-master-0",
                        "MASTER_PORT": 23456}.items():
        pod.setenv(name, str(value))
    command = commands["Worker"]
    total = int(command[command.index("--num_processes") + 1])
    out = dry_run(command, capsys)
    assert f"--nnodes {pods} --nproc_per_node {total // pods}" in out, out
    assert "--node_rank 1 --master_addr accel-train-master-0 --master_port 23456" in out, out


@pytest.mark.parametrize("script", ["sbatch_launch.sh", "sbatch_srun.sh"])
def test_sbatch_scripts_are_valid_bash_with_their_resources(script):
    path = FOLDER / script
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    directives = dict(line[len("#SBATCH "):].split("=", 1) for line in path.read_text().splitlines()
                      if line.startswith("#SBATCH ") and "=" in line)
    assert {"--nodes", "--ntasks-per-node"} <= set(directives)
    run = [line for line in path.read_text().splitlines() if line.startswith("srun ")]
    assert len(run) == 1
    if "accel launch" in run[0]:  # one launcher per node, each starting its node's share
        assert directives["--ntasks-per-node"] == "1" and f"--num_machines {directives['--nodes']}" in run[0]
    else:  # one task per process: Accelerator() forms the group from SLURM's variables
        assert run[0] == "srun python train.py"
