"""`accel plan` with expert parallelism (ep: a mixture of experts' expert parameters divided among ep of the
data-parallel ranks) and the pipeline schedules (`--pp_schedule`: the pipeline layouts' bubble)."""

from __future__ import annotations

import pytest
import yaml

from accel.backends.launchable import check_launchable
from accel.cli.main import main
from accel.config import config_from_dict
from accel.planning.estimate import ModelSpec, Param, spec_from_module
from accel.planning.plan import GB, Hardware, PlanError, model_shape, plan, write_config

SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")

MIXTRAL = """
import torch
from transformers import MixtralConfig, MixtralForCausalLM


def build():
    config = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128)
    with torch.device("meta"):
        return MixtralForCausalLM(config)
"""


@pytest.fixture(autouse=True)
def _no_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no stored `--calibrate` figures


@pytest.fixture
def mixtral(tmp_path, monkeypatch):
    """A tiny Mixtral as MODEL (module:callable) and as (spec, module)."""
    (tmp_path / "tiny_moe.py").write_text(MIXTRAL)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    module = importlib.import_module("tiny_moe").build()
    return "tiny_moe:build", spec_from_module(module, "tiny_moe"), module


def dense(blocks: int = 4, width: int = 64) -> ModelSpec:
    """A stack of `blocks` blocks of two width x width matrices, with an embedding: no experts."""
    params = [Param("embed.weight", (256, width), 4, None)]
    for b in range(blocks):
        params += [Param(f"layers.{b}.{name}.weight", (width, width), 4, f"layers.{b}") for name in ("a", "b")]
    return ModelSpec("dense", params)


def test_mixtral_shape_knows_its_experts(mixtral):
    _, spec, module = mixtral
    result = plan(spec, Hardware(num_processes=4, device_memory=16 * GB), 8, 128, module=module)
    shape = result["shape"]
    assert shape["experts"] == 4 and shape["top_k"] == 2 and shape["moe_layers"] == 2
    assert shape["expert_params"] == sum(p.numel for p in spec.params if p.expert) > 0
    assert result["expert_degrees"] == [1, 2, 4]
    # without the config, E from the stacked experts' dim 0
    assert model_shape(spec).experts == 4


def test_ep2_layouts_on_4_processes_hold_less(mixtral):
    _, spec, module = mixtral
    rows = plan(spec, Hardware(num_processes=4, device_memory=16 * GB), 8, 128, module=module)["layouts"]
    ep2 = [r for r in rows if r["ep_size"] == 2]
    assert ep2 and all(r["dp_size"] % 2 == 0 for r in ep2)
    assert {r["zero_stage"] for r in ep2} == {0, 1, 2, 3}  # ZeRO-1 x ep
    staged = [r for r in ep2 if r["pp_size"] == 2]  # pp 2 x ep 2 (dp 2): each stage 1/2 the layers
    assert staged and all(r["dp_size"] == 2 and r["tp_size"] == 1 for r in staged)
    flat = next(r for r in ep2 if r["pp_size"] == 1 and r["tp_size"] == 1 and r["zero_stage"] == 0)
    assert max(r["model_state_bytes_per_rank"] for r in staged if r["zero_stage"] == 0) < \
        flat["model_state_bytes_per_rank"]  # DDP: a stage's layers, not all of them
    assert any(r["offload"] for r in ep2)  # ZeRO-3's offload: the experts' own units too
    assert {r["tp_size"] for r in ep2} == {1, 2}  # ep x tp: dp 2 x tp 2

    def ddp(ep):
        return next(r for r in rows if r["ep_size"] == ep and r["zero_stage"] == 0 and r["pp_size"] == 1
                    and r["tp_size"] == 1 and r["activation_checkpointing"] == "no" and r["micro_batches"] == 1)

    one, two = ddp(1), ddp(2)
    assert two["memory_per_rank_bytes"] < one["memory_per_rank_bytes"]
    assert two["model_state_bytes_per_rank"] < one["model_state_bytes_per_rank"]
    assert two["time_breakdown_s"]["expert_parallel"] > 0 == one["time_breakdown_s"]["expert_parallel"]


@pytest.mark.parametrize("key", ["sp_size", "cp_size"])
def test_ep_with_sequence_parallelism_is_planned(mixtral, key):
    """ep with sp/cp is proposed (it was skipped: check_available refused it); the sequence ranks are more
    copies of each expert, so ZeRO-3 shards the experts over dp x seq / ep of them."""
    _, spec, module = mixtral
    rows = plan(spec, Hardware(num_processes=8, device_memory=16 * GB), 8, 128, module=module,
                **{key: 2})["layouts"]
    both = [r for r in rows if r["ep_size"] == 2 and r[key] == 2 and r["tp_size"] == 1]
    assert {r["zero_stage"] for r in both} == {0, 1, 2, 3}
    assert all(r["time_breakdown_s"]["expert_parallel"] > 0 for r in both)

    def state(zero, ep):
        return next(r["model_state_bytes_per_rank"] for r in rows if r["ep_size"] == ep and r["zero_stage"] == zero
                    and r[key] == 2 and r["tp_size"] == 1 and not r["offload"])

    assert state(0, 2) < state(0, 1) and state(3, 2) <= state(3, 1)  # ZeRO-3: 1 of 4 experts' rows either way


def test_ep_size_fixes_the_degree_and_is_written(mixtral, tmp_path):
    _, spec, module = mixtral
    result = plan(spec, Hardware(num_processes=4, device_memory=16 * GB), 8, 128, module=module, ep_size=2)
    assert {r["ep_size"] for r in result["layouts"]} == {2}
    saved = yaml.safe_load(write_config(result, tmp_path / "ep.yaml").read_text())
    assert saved["parallelism"]["ep_size"] == 2
    check_launchable(config_from_dict(saved, "ep.yaml"))


@pytest.mark.parametrize("ep, procs, fragment", [
    ("3", "4", "--ep_size 3: does not divide the model's 4 experts per layer"),
    ("4", "2", "--ep_size 4: does not divide the 2 processes"),
    ("0", "4", "--ep_size 0"),
])
def test_bad_ep_size_is_one_line(mixtral, ep, procs, fragment, capsys):
    name, _, _ = mixtral
    assert main(["plan", name, "--num_processes", procs, "--seq_len", "64", "--ep_size", ep]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and "Traceback" not in err, err


def test_ep_size_without_experts_is_refused():
    with pytest.raises(PlanError, match="--ep_size 2: the model has no mixture-of-experts layers"):
        plan(dense(), Hardware(num_processes=4), 8, 64, ep_size=2)
    assert {r["ep_size"] for r in plan(dense(), Hardware(num_processes=4), 8, 64)["layouts"]} == {1}


def test_text_output_has_the_ep_column(mixtral, capsys):
    name, _, _ = mixtral
    assert main(["plan", name, "--num_processes", "4", "--batch_size", "8", "--seq_len", "64", "--ep_size",
                 "2", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert " ep " in out and "EP 2" in out


def _pp2(rows: list[dict], m: int) -> dict:
    return next(r for r in rows if r["pp_size"] == 2 and r["micro_batches"] == m and r["zero_stage"] == 0
                and r["activation_checkpointing"] == "no")


def test_zero_bubble_schedule_is_faster_than_1f1b():
    hw = Hardware(num_processes=2, device_memory=16 * GB)
    base = plan(dense(), hw, 8, 64)["layouts"]
    zbv = plan(dense(), hw, 8, 64, pp_schedule="ZBVZeroBubble")["layouts"]
    one, v = _pp2(base, 2), _pp2(zbv, 2)
    assert v["pp_schedule"] == "ZBVZeroBubble" and one["pp_schedule"] == "1F1B"
    assert v["step_time_s"] < one["step_time_s"]
    assert v["time_breakdown_s"]["compute"] < one["time_breakdown_s"]["compute"]


def test_gpipe_holds_every_micro_batch():
    """GPipe runs all m forwards before the first backward: its activations are m micro-batches', 1F1B's p."""
    from accel.planning.plan import pipeline_in_flight

    assert pipeline_in_flight(8, 2, "GPipe") == pipeline_in_flight(8, 2, "LoopedBFS") == 8
    assert pipeline_in_flight(8, 2, "1F1B") == pipeline_in_flight(8, 2, "ZBVZeroBubble") == 2
    assert pipeline_in_flight(1, 4, "1F1B") == 1 and pipeline_in_flight(8, 1, "GPipe") == 1
    hw = Hardware(num_processes=2, device_memory=16 * GB)
    one = _pp2(plan(dense(), hw, 8, 64)["layouts"], 8)
    gpipe = _pp2(plan(dense(), hw, 8, 64, pp_schedule="GPipe")["layouts"], 8)
    assert gpipe["memory_per_rank_bytes"] > one["memory_per_rank_bytes"]


def test_split_backward_schedules_with_data_parallelism_only_on_ddp_stages():
    for schedule in SPLIT_BACKWARD:
        rows = plan(dense(8), Hardware(num_processes=4, device_memory=16 * GB), 16, 64, pp_schedule=schedule)[
            "layouts"]
        piped = [r for r in rows if r["pp_size"] > 1]
        assert piped and all(r["pp_schedule"] == schedule for r in piped)
        replicated = [r for r in piped if r["dp_size"] * r["sp_size"] * r["cp_size"] > 1]
        assert replicated, schedule  # accel averages DDP stages' gradients itself: ZeRO 0/1 without TP
        assert all(r["zero_stage"] <= 1 and r["tp_size"] == 1 for r in replicated), schedule
        if schedule == "DualPipeV":
            assert all(r["micro_batches"] >= 2 * r["pp_size"] for r in piped)
    # 1F1B keeps its pipeline layouts with data parallelism
    rows = plan(dense(8), Hardware(num_processes=4, device_memory=16 * GB), 16, 64)["layouts"]
    assert any(r["pp_size"] > 1 and r["dp_size"] > 1 for r in rows)


def test_pp_schedule_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    result = plan(dense(), Hardware(num_processes=2, device_memory=16 * GB), 8, 64, pp_schedule="ZBVZeroBubble")
    index = next(i for i, r in enumerate(result["layouts"]) if r["pp_size"] == 2 and r["fits"])
    saved = yaml.safe_load(write_config({**result, "recommended": index}, tmp_path / "pp.yaml").read_text())
    assert saved["parallelism"]["pp_schedule"] == "ZBVZeroBubble" and saved["parallelism"]["pp_size"] == 2
    check_launchable(config_from_dict(saved, "pp.yaml"))
    with pytest.raises(SystemExit) as exited:  # argparse's choices: one line naming the flag
        main(["plan", "gpt2", "--pp_schedule", "Nope"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "--pp_schedule" in err and "DualPipeV" in err
