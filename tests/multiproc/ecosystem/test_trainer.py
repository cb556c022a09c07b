"""transformers' `Trainer`, unchanged, on accel through the shim, against the real Accelerate 1.15 running the same
script (scripts/trainer_worker.py), on 1 and 2 CPU processes.

Five launches, each running several scenarios: Accelerate on 1 and 2 processes (DDP); accel on 1 process, on 2
under DDP (plus Trainer's own `fsdp="full_shard"` -> ZeRO-3 and `fsdp_config={"reshard_after_forward": False}` ->
ZeRO-2), and on 2 under `accel launch --zero_stage 3`. Accelerate cannot shard on CPU, so accel's ZeRO runs are
compared with Accelerate's DDP run of the same scenario.

Checked per logged step (loss, grad_norm, learning_rate, eval_loss, with equal step and epoch) and on the final
weights:
  same layout (DDP vs DDP), fp32 and bf16   rtol 1e-6 per value, weights atol 1e-6 (measured: bit-equal)
  ZeRO 2/3 vs DDP, fp32                     rtol 1e-5, weights atol 1e-5 (measured: grad_norm 1.2e-7, weights equal)
  ZeRO 2/3 vs DDP, bf16                     loss rtol 2e-3, grad_norm rtol 2e-2, weights mean |diff| 1e-3 and max
                                            4 x lr (FSDP2 computes in bf16 parameters where DDP autocasts: Adam's
                                            first steps flip the sign of a few tiny gradients; measured loss 1.1e-4,
                                            grad_norm 2.2e-3, weights mean 2e-4, max 1.7e-2)
Also: the Trainer saw the truth (`distributed_type` FSDP, `is_fsdp_enabled`, DTensor parameters under ZeRO), a run
resumed from `checkpoint-2` (written by `save_fsdp_model`/`save_fsdp_optimizer` under ZeRO) ends bit-equal to the
uninterrupted run, and `trainer.save_model` -> `from_pretrained` keeps the tied weights tied and gives the logits of
the trained weights (atol 1e-6)."""

import json
import os
import sys

import pytest
import torch
import warm_python
from _launch import ROOT, SCRIPTS, accel_launch
from safetensors.torch import load_file

pytestmark = pytest.mark.multiproc
pytest.importorskip("transformers")
if __import__("importlib.util").util.find_spec("accelerate") is None:
    pytest.skip("the real accelerate package (a test extra) is not installed", allow_module_level=True)

SCRIPT = SCRIPTS / "trainer_worker.py"
BASE = ["basic", "gpt2", "llama"]
LAYOUTS = {  # name -> (implementation, processes, extra accel launch flags, scenarios)
    "accelerate_1p": ("accelerate", 1, [], BASE),
    "accelerate_2p": ("accelerate", 2, [], BASE),
    "accel_1p": ("accel", 1, [], BASE),
    "accel_2p": ("accel", 2, [], BASE + ["gpt2_full_shard", "llama_shard_grad_op"]),
    "accel_2p_zero3": ("accel", 2, ["--zero_stage", "3"], BASE),
}
ZERO = {("accel_2p", "gpt2_full_shard"): 3, ("accel_2p", "llama_shard_grad_op"): 2,
        **{("accel_2p_zero3", s): 3 for s in BASE}}
BF16 = {"llama", "llama_shard_grad_op"}
LR = 5e-3  # the worker's learning rate
CASES = [(layout, s) for layout, (impl, _, _, scenarios) in LAYOUTS.items() if impl == "accel" for s in scenarios]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(cmd: list, env: dict, timeout: int = 300) -> None:
    proc = warm_python.run(cmd, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def _launch(impl: str, procs: int, flags: list, scenarios: list, folder, env: dict) -> None:
    args = [SCRIPT, "--out", folder, "--scenarios", ",".join(scenarios)]
    if impl == "accel":
        accel_launch(env, "--accelerate_shim", "--cpu", "--num_processes", procs, *flags, *args, timeout=300)
    elif procs == 1:
        _run([sys.executable, *args], env)
    else:  # Accelerate's multi-process CPU launch (its --cpu --num_processes 2 runs one process)
        _run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu", "--num_processes",
              str(procs), "--main_process_port", str(_free_port()), *args], {**env, "ACCELERATE_USE_CPU": "true"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """layout -> (records, folder), from one launch per layout."""
    root = tmp_path_factory.mktemp("trainer")
    home = root / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_", "MASTER_", "TORCHELASTIC"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONPATH")}
    env.update(HOME=str(home), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONWARNINGS="ignore")
    results = {}
    for layout, (impl, procs, flags, scenarios) in LAYOUTS.items():
        folder = root / layout
        folder.mkdir()
        _launch(impl, procs, flags, scenarios, folder, env)
        results[layout] = json.loads((folder / "records.json").read_text()), folder
    return results


def _reference(layout: str) -> str:
    return "accelerate_1p" if LAYOUTS[layout][1] == 1 else "accelerate_2p"


def _base(scenario: str) -> str:
    return scenario.split("_")[0]


def _tolerances(layout: str, scenario: str) -> dict:
    if (layout, scenario) not in ZERO:
        return {"loss": 1e-6, "grad_norm": 1e-6, "eval_loss": 1e-6}
    if scenario in BF16:
        return {"loss": 2e-3, "grad_norm": 2e-2, "eval_loss": 2e-3}
    return {"loss": 1e-5, "grad_norm": 1e-5, "eval_loss": 1e-5}


def _compare_logs(mine: list, theirs: list, rtol: dict, what: str) -> None:
    assert len(mine) == len(theirs) > 0, f"{what}: {len(mine)} logged entries, reference {len(theirs)}"
    for ours, ref in zip(mine, theirs):
        assert ours.keys() == ref.keys() and (ours["step"], ours["epoch"]) == (ref["step"], ref["epoch"]), (ours, ref)
        if "learning_rate" in ref:  # eval entries have none (pytest 9.2's approx refuses None)
            assert ours["learning_rate"] == pytest.approx(ref["learning_rate"], rel=1e-9), (what, ours, ref)
        for key, tol in rtol.items():
            if key in ref:
                assert ours[key] == pytest.approx(ref[key], rel=tol), f"{what} step {ref['step']}: {key}"


def _compare_weights(mine: dict, theirs: dict, layout: str, scenario: str) -> None:
    assert mine.keys() == theirs.keys()
    diffs = torch.cat([(mine[k] - theirs[k]).abs().flatten() for k in theirs])
    if (layout, scenario) in ZERO and scenario in BF16:
        assert float(diffs.mean()) <= 1e-3 and float(diffs.max()) <= 4 * LR, (float(diffs.mean()), float(diffs.max()))
    else:
        atol = 1e-5 if (layout, scenario) in ZERO else 1e-6
        assert float(diffs.max()) <= atol


@pytest.mark.parametrize("layout,scenario", CASES, ids=[f"{layout}-{s}" for layout, s in CASES])
def test_trainer_matches_accelerate(runs, layout, scenario):
    records, folder = runs[layout]
    ref_records, ref_folder = runs[_reference(layout)]
    mine, theirs = records[scenario], ref_records[_base(scenario)]
    assert (mine["impl"], theirs["impl"]) == ("accel", "accelerate")  # the shim was in use, and only there
    assert mine["world"] == theirs["world"] == LAYOUTS[layout][1]
    stage = ZERO.get((layout, scenario))
    if stage:  # the Trainer was told the model is sharded, and it is: its sharded save/load path ran
        assert (mine["distributed_type"], mine["is_fsdp_enabled"], mine["fsdp_version"]) == ("FSDP", True, 2)
        assert mine["sharded"] and mine["zero_stage"] == stage
    else:
        assert mine["distributed_type"] == ("NO" if mine["world"] == 1 else "MULTI_CPU")
        assert not mine["is_fsdp_enabled"] and not mine["sharded"]
    _compare_logs(mine["log"], theirs["log"], _tolerances(layout, scenario), f"{layout}/{scenario}")
    _compare_weights(load_file(folder / f"{scenario}.safetensors"),
                     load_file(ref_folder / f"{_base(scenario)}.safetensors"), layout, scenario)


RESUMED = [(layout, s) for layout, s in CASES if s in ("gpt2", "gpt2_full_shard", "llama_shard_grad_op")]


@pytest.mark.parametrize("layout,scenario", RESUMED, ids=[f"{layout}-{s}" for layout, s in RESUMED])
def test_resume_from_checkpoint_equals_uninterrupted_run(runs, layout, scenario):
    records, folder = runs[layout]
    record = records[scenario]
    files = record["checkpoint_files"]
    if (layout, scenario) in ZERO:  # save_fsdp_model / save_fsdp_optimizer's folders, no pickle of theirs
        assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(files) and "pytorch_model_fsdp.bin" not in files
    else:
        assert "optimizer.pt" in files
    after = [e for e in record["log"] if e["step"] > 2]
    assert after and [e for e in record["resumed_log"] if e["step"] > 2] == after
    resumed = load_file(folder / f"{scenario}_resumed.safetensors")
    whole = load_file(folder / f"{scenario}.safetensors")
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


SAVED = [(layout, s) for layout, s in CASES if s != "basic"]


@pytest.mark.parametrize("layout,scenario", SAVED, ids=[f"{layout}-{s}" for layout, s in SAVED])
def test_save_model_then_from_pretrained(runs, layout, scenario):
    record = runs[layout][0][scenario]
    assert record["tied_live"] and record["tied_loaded"]
    assert "model.safetensors" in record["saved_files"]
    assert record["logits_max_diff"] <= 1e-6
