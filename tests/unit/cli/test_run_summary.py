"""The run says what it runs: `accel launch`'s start line (the layout and the file each value not accel's default came
from), Accelerate's summary from `print(accelerator.state)` and `print(accelerator)`, `accel env`'s sources, and one
note when gradient_accumulation_steps > 1 meets a loop that never enters `accumulate()`."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import pytest
import torch

from accel import Accelerator, ParallelismConfig, PartialState
from accel.cli import launch
from accel.cli.main import main

SAVED = "mixed_precision: bf16\ngradient_accumulation_steps: 2\nparallelism:\n  zero_stage: 2\n"  # `accel config`'s
ROOT = Path(__file__).resolve().parents[3]
NOTE = "gradient_accumulation_steps is 2 but the loop reached its first optimizer step without entering"


@pytest.fixture
def saved_config(monkeypatch, tmp_path):
    """A HOME whose saved config (what `accel config` writes) asks for ZeRO-2, bf16 and accumulation 2."""
    for name in ("ACCEL_CONFIG_FILE", "ACCEL_LAUNCH_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "PET_NNODES",
                 "PET_NPROC_PER_NODE", "PET_NODE_RANK", "SLURM_STEP_ID", "SLURM_STEPID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / ".cache" / "accel" / "default_config.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(SAVED)
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    return path, script


# -- accel launch's start line ---------------------------------------------------------------------------------------

def test_start_line_names_the_layout_and_the_saved_file(saved_config, monkeypatch, capsys):
    path, script = saved_config
    monkeypatch.setattr(launch, "_run_torchrun", lambda cfg, argv, preemptible=True: 0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the thread line is output.py's own (test_launch_output.py)
    assert main(["launch", "--cpu", "--num_processes", "2", str(script)]) == 0
    assert capsys.readouterr().err == (
        "accel launch: 2 processes (MULTI_CPU, gloo), ZeRO-2 (FSDP2), dp_shard 2, mixed precision bf16, gradient "
        f"accumulation 2 (set by {path}: mixed_precision bf16, gradient_accumulation_steps 2, zero_stage 2; accel "
        "launch flags: num_processes 2, use_cpu true)\n")


def test_one_process_says_it_too(saved_config, monkeypatch, capsys):
    path, script = saved_config
    monkeypatch.setattr(launch, "_exec_single", lambda cfg, argv: 0)
    assert main(["launch", "--cpu", str(script)]) == 0
    assert capsys.readouterr().err.startswith("accel launch: 1 process (NO), ZeRO-2 (FSDP2), mixed precision bf16, "
                                              f"gradient accumulation 2 (set by {path}: ")
    path.unlink()
    assert main(["launch", "--cpu", "--num_processes", "1", str(script)]) == 0
    assert capsys.readouterr().err == ("accel launch: 1 process (NO), no data parallelism, mixed precision no, "
                                       "gradient accumulation 1 (set by accel launch flags: use_cpu true)\n")


def test_dry_run_prints_no_start_line(saved_config, capsys):
    _, script = saved_config
    assert main(["launch", "--cpu", "--num_processes", "2", "--dry_run", str(script)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "gradient_accumulation_steps: 2  # " in captured.out


@pytest.mark.parametrize("sizes, zero_stage, extra, words", [
    ((2, None), 0, {}, "DDP, dp_replicate 2"),
    ((2, None), 1, {}, "ZeRO-1, dp_replicate 2"),
    ((None, 4), 3, {}, "ZeRO-3 (FSDP2), dp_shard 4"),
    ((2, 2), 2, {"offload_params": True}, "HSDP ZeRO-2 (FSDP2), dp_replicate 2, dp_shard 2, CPU offload"),
    ((None, 2), 0, {"tp_size": 2}, "FSDP2, dp_shard 2, tp 2"),
    ((1, 1), 0, {"pp_size": 2}, "no data parallelism, pp 2"),
])
def test_layout_words(sizes, zero_stage, extra, words):
    from accel.config.degrees import layout_words

    par = ParallelismConfig(zero_stage=zero_stage, **extra)
    replicate, shard = (size or 1 for size in sizes)
    assert layout_words(par, replicate, shard) == words


# -- print(accelerator.state), print(accelerator) -----------------------------------------------------------------

ACCELERATE_FIELDS = ("Distributed environment: NO\nNum processes: 1\nProcess index: 0\nLocal process index: 0\n"
                     "Device: cpu\n")


def test_state_and_accelerator_print_accelerates_summary_then_accels_degrees(saved_config):
    PartialState._reset_state()
    assert repr(PartialState(cpu=True)) == ACCELERATE_FIELDS  # Accelerate's PartialState.__repr__
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(zero_stage=0))
    summary = (ACCELERATE_FIELDS + "\nMixed precision type: bf16\n"  # AcceleratorState.__repr__ adds this line
               "Parallelism: no data parallelism, dp_replicate 1, dp_shard 1, tp 1, pp 1, cp 1, sp 1, ep 1\n")
    assert repr(accelerator.state) == str(accelerator.state) == summary
    assert repr(accelerator) == summary + "Gradient accumulation steps: 2\n"


@pytest.mark.parametrize("gpus, words", [(0, "4 processes (MULTI_CPU, gloo)"), (4, "4 processes (MULTI_GPU, nccl)")])
def test_four_processes_without_cpu_say_whether_they_run_on_gpus_or_the_cpu(saved_config, monkeypatch, capsys, gpus,
                                                                            words):
    """docs/getting_started.md: `accel launch --num_processes 4` is one process per GPU on NCCL where there are GPUs,
    and on a machine without one the same four on the CPU over gloo, which the start line says."""
    path, script = saved_config
    path.unlink()
    monkeypatch.setattr(launch, "_run_torchrun", lambda cfg, argv, preemptible=True: 0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert main(["launch", "--num_processes", "4", str(script)]) == 0
    assert capsys.readouterr().err == (f"accel launch: {words}, DDP, dp_replicate 4, mixed precision no, gradient "
                                       "accumulation 1 (set by accel launch flags: num_processes 4)\n")
    getting_started = " ".join((ROOT / "docs" / "getting_started.md").read_text().split())
    assert "accel launch --num_processes 4 examples/quickstart.py # four processes: one per GPU (NCCL), or CPU (gloo)" \
        in getting_started
    assert "e.g. on a laptop `accel launch: 4 processes (MULTI_CPU, gloo), DDP, dp_replicate 4, ...`" in getting_started


# -- accel env ---------------------------------------------------------------------------------------------------

def test_env_names_where_each_value_came_from(saved_config, capsys):
    path, _ = saved_config
    assert main(["env", "--cpu", "--num_processes", "2"]) == 0
    out = capsys.readouterr().out
    assert ("- run: 2 processes (MULTI_CPU, gloo), ZeRO-2 (FSDP2), dp_shard 2, mixed precision bf16, gradient "
            "accumulation 2\n") in out
    for line in (f"mixed_precision: bf16  # {path}", f"gradient_accumulation_steps: 2  # {path}",
                 f"  zero_stage: 2  # {path}", "num_processes: 2  # accel env flags",
                 "rdzv_backend: static  # packaged default", "  enabled: false  # default"):
        assert f"    {line}\n" in out, line


def test_env_names_the_cluster_variable_behind_each_value(saved_config, monkeypatch, capsys):
    """docs/clusters.md: `accel env` names each value's source, a scheduler's variables included."""
    path, _ = saved_config
    path.unlink()
    for name, value in {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1",
                        "PET_MASTER_ADDR": "accel-train-node-0-0", "PET_MASTER_PORT": "29400"}.items():
        monkeypatch.setenv(name, value)
    assert main(["env", "--cpu"]) == 0
    out = capsys.readouterr().out
    for line in ("num_processes: 4  # $PET_NPROC_PER_NODE x num_machines (Kubeflow Trainer)",
                 "num_machines: 2  # $PET_NNODES (Kubeflow Trainer)",
                 "machine_rank: 1  # $PET_NODE_RANK (Kubeflow Trainer)",
                 "main_process_ip: accel-train-node-0-0  # $PET_MASTER_ADDR (Kubeflow Trainer)",
                 "main_process_port: 29400  # $PET_MASTER_PORT (Kubeflow Trainer)", "use_cpu: true  # accel env flags",
                 "mixed_precision: 'no'  # packaged default"):
        assert f"    {line}\n" in out, line
    for page in ("getting_started.md", "clusters.md"):  # what the pages say, held by this test and the one above
        text = " ".join((ROOT / "docs" / page).read_text().split())
        assert ("`accel env` shows the result and where each value came from" in text
                or "`accel launch --dry_run` and `accel env` name each value's source" in text), page


# -- the accumulation note ------------------------------------------------------------------------------------------

def _steps(accelerator: Accelerator, count: int, windowed: bool) -> tuple[list[str], torch.Tensor]:
    """`count` steps of a fixed loss; the notes raised and the first step's gradient."""
    model = torch.nn.Linear(4, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    grads = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(count):
            with accelerator.accumulate(model) if windowed else contextlib.nullcontext():
                accelerator.backward(model(torch.ones(2, 4)).sum())
                grads.append(model.weight.grad.clone())
                optimizer.step()
                optimizer.zero_grad()
    return [str(w.message) for w in caught if NOTE in str(w.message)], grads[0]


def test_accumulation_without_accumulate_is_said_once_and_the_numbers_stay(saved_config):
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(zero_stage=0))
    notes, grad = _steps(accelerator, 3, windowed=False)
    assert len(notes) == 1, notes
    assert "backward divides each loss by 2" in notes[0] and "accelerator.accumulate(" in notes[0]
    assert torch.equal(grad, torch.full((1, 4), 1.0))  # Accelerate's numbers: the loss (gradient 2) divided by 2


def test_no_note_inside_accumulate_off_the_main_process_or_without_accumulation(saved_config, monkeypatch):
    path, _ = saved_config
    plain = ParallelismConfig(zero_stage=0)
    assert _steps(Accelerator(cpu=True, parallelism_config=plain), 4, windowed=True)[0] == []
    import accel.optimizer

    with monkeypatch.context() as patched:
        patched.setattr(accel.optimizer, "_is_main_process", lambda: False)
        assert _steps(Accelerator(cpu=True, parallelism_config=plain), 2, windowed=False)[0] == []
    path.write_text("mixed_precision: bf16\n")  # gradient_accumulation_steps 1
    assert _steps(Accelerator(cpu=True, parallelism_config=plain), 2, windowed=False)[0] == []


# -- the run: a saved config, two processes -------------------------------------------------------------------

WORKER = """import torch
from accel import Accelerator

accelerator = Accelerator()
model = torch.nn.Linear(4, 2)
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
if accelerator.is_main_process:
    print(accelerator.state)
for _ in range(3):
    accelerator.backward(model(torch.ones(2, 4, device=accelerator.device)).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
"""


@pytest.mark.multiproc
def test_a_saved_config_is_said_by_the_launcher_the_state_and_the_first_step(run_accel, isolated_env, tmp_path):
    path = tmp_path / "home" / ".cache" / "accel" / "default_config.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(SAVED)
    (tmp_path / "train.py").write_text(WORKER)
    result = run_accel("launch", "--cpu", "--num_processes", "2", "train.py", timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.startswith("accel launch: 2 processes (MULTI_CPU, gloo), ZeRO-2 (FSDP2), dp_shard 2, mixed "
                                    f"precision bf16, gradient accumulation 2 (set by {path}: "), result.stderr
    assert "Distributed environment: FSDP  Backend: gloo\nNum processes: 2\nProcess index: 0\n" in result.stdout
    assert ("\nMixed precision type: bf16\nParallelism: ZeRO-2 (FSDP2), dp_replicate 1, dp_shard 2, tp 1, pp 1, cp 1, "
            "sp 1, ep 1\n") in result.stdout
    assert result.stderr.count(NOTE) == 1, result.stderr  # once, on the main process
