"""examples/clusters: each engine's job file, parsed, and its command run as `accel launch --dry_run` (as a CPU job)
with the variables the engine sets in a pod: the job it would start is the one the file describes. The
Kubernetes manifests are checked against compact schemas of their CRDs (k8s_schemas.py, which names the sources), and
the RayJob's entrypoint against ray_train.py's own parser, without starting Ray."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml
from k8s_schemas import validate_manifest

from accel.cli.main import main

REPO = Path(__file__).resolve().parents[3]
FOLDER = REPO / "examples" / "clusters"
MANIFESTS = ("trainjob.yaml", "pytorchjob.yaml", "rayjob.yaml")
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


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_manifest_matches_its_crd_schema(manifest):
    assert validate_manifest(yaml.safe_load((FOLDER / manifest).read_text())) == []


# a slip in each manifest's text, and the problem the check names: an unknown field, a wrong type, a missing required
# field, a bad enum value (the check can fail, and says where)
PLANTED = [
    ("trainjob.yaml", "numProcPerNode:", "numProcsPerNode:", "spec.trainer.numProcsPerNode: unknown field"),
    ("trainjob.yaml", "numNodes: 2", 'numNodes: "2"', "spec.trainer.numNodes: expected an integer"),
    ("trainjob.yaml", "name: torch-distributed", "kind: ClusterTrainingRuntime", "spec.runtimeRef.name: required"),
    ("trainjob.yaml", "kind: TrainJob", "kind: TrainingJob", "has no schema"),
    ("pytorchjob.yaml", "restartPolicy: OnFailure", "restartPolicy: OnFail",
     "spec.pytorchReplicaSpecs.Master.restartPolicy: 'OnFail' is not one of"),
    ("pytorchjob.yaml", "    Worker:", "    Workers:", "spec.pytorchReplicaSpecs.Workers: unknown key"),
    ("pytorchjob.yaml", "- name: pytorch", "- nmae: pytorch",
     "spec.pytorchReplicaSpecs.Master.template.spec.containers[0].name: required field missing"),
    ("pytorchjob.yaml", "          containers:", "          container:",
     "spec.pytorchReplicaSpecs.Master.template.spec.container: unknown field"),
    ("pytorchjob.yaml", "replicas: 1", "replicas: one",
     "spec.pytorchReplicaSpecs.Master.replicas: expected an integer"),
    ("rayjob.yaml", 'num-cpus: "0"', "num-cpus: 0",
     "spec.rayClusterSpec.headGroupSpec.rayStartParams.num-cpus: expected a string"),
    ("rayjob.yaml", "minReplicas: 2", "minReplica: 2", "spec.rayClusterSpec.workerGroupSpecs[0].minReplicas: required"),
    ("rayjob.yaml", "memory: 4Gi}\n    workerGroupSpecs", "memory: 4GB}\n    workerGroupSpecs",
     "spec.rayClusterSpec.headGroupSpec.template.spec.containers[0].resources.limits.memory: expected a quantity"),
    ("rayjob.yaml", "  entrypoint:", "  entryPoint:", "spec.entryPoint: unknown field"),
    ("rayjob.yaml", "shutdownAfterJobFinishes: true", "shutdownAfterJobFinishes: 'true'",
     "spec.shutdownAfterJobFinishes: expected a boolean"),
    ("rayjob.yaml", "shutdownAfterJobFinishes: true",
     "deletionStrategy: {deletionRules: []}\n  shutdownAfterJobFinishes: true",
     "spec.deletionStrategy: not described in tests/unit/k8s_schemas.py"),
    ("rayjob.yaml", "  name: accel-train", "  name: accel_train", "metadata.name: 'accel_train' does not match"),
]


@pytest.mark.parametrize("manifest, text, typo, problem", PLANTED,
                         ids=[f"{m}:{t.split()[0]}" for m, _, t, _ in PLANTED])
def test_a_planted_slip_is_caught_and_named(manifest, text, typo, problem):
    original = (FOLDER / manifest).read_text()
    assert text in original, f"{manifest} no longer has {text!r}: update the planted slip"
    errors = validate_manifest(yaml.safe_load(original.replace(text, typo, 1)))
    assert any(problem in error for error in errors), errors


def test_operator_rules_beyond_the_crds():
    """What the operators' own validation wants and the CRDs cannot say."""
    pytorch = yaml.safe_load((FOLDER / "pytorchjob.yaml").read_text())["spec"]["pytorchReplicaSpecs"]
    assert pytorch["Master"]["replicas"] == 1  # the training-operator's webhook: exactly one Master
    for spec in pytorch.values():  # ... and in each role a container named pytorch, with an image
        assert any(c["name"] == "pytorch" and c.get("image") for c in spec["template"]["spec"]["containers"])
    cluster = yaml.safe_load((FOLDER / "rayjob.yaml").read_text())["spec"]["rayClusterSpec"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:  # KubeRay's validation.go
        assert group["template"]["spec"]["containers"]
        assert not (group.get("resources") and {"num-cpus", "num-gpus", "memory", "resources"}
                    & set(group.get("rayStartParams", {})))
    for group in cluster["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]


def load_ray_train() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("ray_train_example", FOLDER / "ray_train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ray_capacity(job: dict) -> tuple[int, bool]:
    """How many 1-CPU Ray Train workers the RayJob's worker pods hold (the head takes none), and whether any pod has
    a GPU."""
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    capacity = sum(group["replicas"] * int(group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
                   for group in cluster["workerGroupSpecs"])
    gpus = any("nvidia.com/gpu" in container.get("resources", {}).get("limits", {})
               for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
               for container in group["template"]["spec"]["containers"])
    return capacity, gpus


def test_rayjob_entrypoint_parses_with_ray_train_and_fits_the_worker_pods(monkeypatch):
    job = yaml.safe_load((FOLDER / "rayjob.yaml").read_text())
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "python" and (REPO / argv[1]).resolve() == FOLDER / "ray_train.py"
    module = load_ray_train()
    calls = []
    monkeypatch.setattr(module, "run_on_ray", lambda config, workers, storage: calls.append(workers))
    monkeypatch.setattr(module, "train_loop", lambda config: pytest.fail("--workers should run under Ray"))
    monkeypatch.setattr(sys, "argv", argv[1:])
    module.main()  # ray_train.py's own argparse parser: an unknown flag exits here
    assert calls == [ray_capacity(job)[0]]


def fake_module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


class FakeRay:
    """ray, ray.train and ray.train.torch as run_on_ray uses them, recording the calls (no Ray starts)."""

    def __init__(self, monkeypatch):
        self.init_kwargs: dict = {}
        self.scaling: dict = {}
        modules = [fake_module("ray", init=self.init_kwargs.update, shutdown=lambda: None),
                   fake_module("ray.train", RunConfig=dict, ScalingConfig=self.scaling_config),
                   fake_module("ray.train.torch", TorchTrainer=lambda *args, **kwargs: types.SimpleNamespace(
                       fit=lambda: None))]
        for module in modules:
            monkeypatch.setitem(sys.modules, module.__name__, module)

    def scaling_config(self, **kwargs) -> dict:
        self.scaling.update(kwargs)
        return kwargs


def test_ray_train_asks_ray_for_what_the_rayjob_pods_hold(monkeypatch):
    job = yaml.safe_load((FOLDER / "rayjob.yaml").read_text())
    capacity, gpus = ray_capacity(job)
    fake = FakeRay(monkeypatch)
    load_ray_train().run_on_ray({}, capacity, None)
    assert fake.scaling["num_workers"] == capacity and fake.scaling["use_gpu"] == gpus


def test_ray_train_joins_the_rayjob_cluster(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # what Ray's job supervisor gives the entrypoint
    fake = FakeRay(monkeypatch)
    load_ray_train().run_on_ray({}, 2, None)
    assert "num_cpus" not in fake.init_kwargs
