"""`accel plan`: the seed's decision tree on synthetic hardware (models on the meta device, no memory)."""

from __future__ import annotations

import json
import time

import pytest
import torch
import yaml

from accel.cli.main import main
from accel.config import AccelConfig, config_from_dict
from accel.backends.launchable import check_launchable
from accel.planning.estimate import load_module, load_spec, spec_from_module


@pytest.fixture(autouse=True)
def _no_calibration(tmp_path, monkeypatch):
    """Plans use a stored `accel plan --calibrate` as defaults: these tests must not read this machine's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
from accel.planning.plan import GB, Hardware, plan, write_config

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama7b():
    return load_spec("llama")  # LlamaConfig's defaults: 6.7B parameters


def _best(result: dict) -> dict:
    assert result["recommended"] is not None, result["explanation"]
    return result["layouts"][result["recommended"]]


class Wide(torch.nn.Module):
    """Two blocks of one 12.9B-parameter linear: one block's float32 weights and gradient (103 GB) exceed an
    80 GB device, so ZeRO and PP (which gather a whole block) cannot run it."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(65536, 196608, bias=False) for _ in range(2))


def wide() -> torch.nn.Module:
    return Wide()


def test_fits_one_device_gets_data_parallelism():
    result = plan(load_spec("gpt2"), Hardware(num_processes=8), 64, 1024)
    best = _best(result)
    assert (best["tp_size"], best["pp_size"], best["offload"]) == (1, 1, False)
    assert best["zero_stage"] in (0, 1, 2) and best["dp_size"] == 8
    assert "fits one device" in result["explanation"][0]


def test_does_not_fit_one_device_shards(llama7b):
    result = plan(llama7b, Hardware(num_processes=8), 64, 2048)
    best = _best(result)
    assert best["zero_stage"] >= 2 or best["tp_size"] > 1 or best["pp_size"] > 1
    assert "does not fit one device" in result["explanation"][0]
    ddp = [r for r in result["layouts"] if r["zero_stage"] == 0 and r["tp_size"] == r["pp_size"] == 1]
    assert ddp and not any(r["fits"] for r in ddp)
    assert any(line.startswith("Not DDP: none fits") for line in result["explanation"])


def test_largest_layer_too_big_needs_tensor_parallelism():
    with torch.device("meta"):
        spec = spec_from_module(wide(), "wide")
    result = plan(spec, Hardware(num_processes=8), 8, 512)
    best = _best(result)
    assert best["tp_size"] > 1
    assert all(not r["fits"] for r in result["layouts"] if r["tp_size"] == 1)
    assert "largest layer does not fit" in result["explanation"][0]


def test_slow_links_get_pipeline_across_machines_fast_links_do_not(llama7b, tmp_path):
    hw = dict(num_machines=4, num_processes=8, device_memory=40 * GB)
    fast = _best(plan(llama7b, Hardware(inter_bw=50 * GB, **hw), 256, 2048))
    slow_result = plan(llama7b, Hardware(inter_bw=1.25 * GB, **hw), 256, 2048)
    slow = _best(slow_result)
    assert fast["pp_size"] == 1
    assert slow["pp_size"] > 1 and slow["tp_size"] * slow["dp_size"] <= 8  # only PP crosses machines
    assert "slow links between machines -> pipeline parallelism" in slow_result["explanation"][0]
    saved = yaml.safe_load(write_config(slow_result, tmp_path / "c.yaml", "10.0.0.1").read_text())
    assert saved["num_machines"] == 4 and saved["parallelism"]["pp_size"] == slow["pp_size"]
    assert saved["parallelism"]["pp_microbatches"] == slow["micro_batches"]
    check_launchable(config_from_dict(saved, "c.yaml"))


def test_only_offload_fits(llama7b):
    result = plan(llama7b, Hardware(num_processes=1, device_memory=24 * GB), 1, 1024)
    best = _best(result)
    assert best["offload"] and best["zero_stage"] == 3
    fitting = [r for r in result["layouts"] if r["fits"]]
    assert fitting and all(r["offload"] for r in fitting)


def test_70b_llama_planned_in_seconds(tmp_path):
    config = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000}
    (tmp_path / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    result = plan(load_spec(str(tmp_path)), Hardware(num_machines=8, num_processes=8), 512, 4096)
    assert time.perf_counter() - start < 30
    assert 68e9 < result["params"] < 70e9
    best = _best(result)
    assert best["tp_size"] <= 8 and best["dp_size"] * best["tp_size"] * best["pp_size"] == 64


def test_gradient_accumulation_fits_a_large_global_batch(llama7b, tmp_path):
    """7B, global batch 512 x 2048 on 8 x 80 GB: 64 samples per process do not fit in one pass with or without
    checkpointing, so the plan accumulates gradients over smaller micro-batches and writes
    gradient_accumulation_steps; one pass per step is still planned, and does not fit."""
    result = plan(llama7b, Hardware(num_processes=8), 512, 2048)
    best = _best(result)
    assert best["pp_size"] > 1 or best["gradient_accumulation_steps"] > 1
    single = [r for r in result["layouts"] if r["pp_size"] == 1 and r["micro_batches"] == 1]
    assert single and not any(r["fits"] for r in single)
    accumulated = next(r for r in result["layouts"] if r["fits"] and r["gradient_accumulation_steps"] > 1)
    assert accumulated["micro_batch_size"] * accumulated["micro_batches"] == accumulated["per_process_batch"]
    result["recommended"] = result["layouts"].index(accumulated)
    saved = yaml.safe_load(write_config(result, tmp_path / "c.yaml").read_text())
    assert saved["gradient_accumulation_steps"] == accumulated["gradient_accumulation_steps"]
    check_launchable(config_from_dict(saved, "c.yaml"))


def test_json_keys_and_write_launches(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "gpt2", "--num_processes", "2", "--device_memory", "16GB", "--batch_size", "8",
                 "--seq_len", "256", "--json", "--write", "cfg.yaml"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["layouts"][out["recommended"]]
    for key in ("zero_stage", "tp_size", "pp_size", "dp_size", "offload", "activation_checkpointing",
                "micro_batches", "model_state_bytes_per_rank", "memory_per_rank_bytes", "fits", "step_time_s"):
        assert key in row
    assert row["fits"] and row["memory_per_rank_bytes"] >= row["model_state_bytes_per_rank"] > 0
    saved = yaml.safe_load((tmp_path / "cfg.yaml").read_text())
    assert saved["num_processes"] == 2 and saved["parallelism"]["zero_stage"] == row["zero_stage"]
    check_launchable(config_from_dict(saved, "cfg.yaml"))
    (tmp_path / "x.py").write_text("print('hi')\n")
    assert main(["launch", "--dry_run", "--config_file", "cfg.yaml", "x.py"]) == 0


def test_measured_activations_calibrate_the_formula():
    from accel.planning.estimate import load_module
    from accel.planning.plan import model_shape

    module = load_module("gpt2")
    spec = spec_from_module(module, "gpt2")
    result = plan(spec, Hardware(num_processes=2), 8, 128, module=module, measure_activations=True)
    assert "fake-tensor measurement" in result["activation_method"]
    formula = plan(spec, Hardware(num_processes=2), 8, 128, module=module)
    assert formula["activation_method"].startswith("formula")
    row = result["layouts"][0]
    same = next(r for r in formula["layouts"] if all(r[k] == row[k] for k in ("zero_stage", "tp_size", "pp_size",
                "offload", "activation_checkpointing", "micro_batches")))
    assert row["activation_bytes_per_rank"] != same["activation_bytes_per_rank"]
    assert model_shape(spec).layers == 12


def test_hidden_and_heads_come_from_the_config():
    """GPT-2 small: hidden 768 with 12 heads of 64 (the hidden / 128 guess would say 6); a safetensors
    checkpoint (headers only) falls back to the guess."""
    from accel.cli.plan import model

    spec, module = model("gpt2")
    result = plan(spec, Hardware(num_processes=2), 8, 128, module=module)
    assert (result["shape"]["hidden"], result["shape"]["heads"]) == (768, 12)
    assert plan(spec, Hardware(num_processes=2), 8, 128)["shape"]["heads"] == 6


def test_fixed_activation_bytes_do_not_grow_with_the_batch():
    """--activations measured: autocast's cached bf16 weights are a fixed cost, not scaled with the micro-batch
    (a whole-model factor at one sample made full checkpointing of big models look 10x larger)."""
    from accel.planning.plan import activation_calibration, model_shape

    module = load_module("gpt2")
    spec = spec_from_module(module, "gpt2")
    shape = model_shape(spec, 768, 12)
    cal = activation_calibration(module, shape, 64, "bf16")
    assert cal["full"]["fixed_bytes"] >= 2 * spec.numel * 0.9  # the bf16 copy of the weights
    assert 0.5 < cal["full"]["scale"] < 2 and 0.5 < cal["no"]["scale"] < 2


def test_text_output_explains(capsys):
    assert main(["plan", "gpt2", "--num_processes", "4", "--batch_size", "16", "--seq_len", "128"]) == 0
    out = capsys.readouterr().out
    assert "Branch:" in out and "Recommended:" in out and "Not " in out


@pytest.mark.parametrize("args, fragment", [
    (["gpt2", "--batch_size", "0"], "--batch_size"),
    (["gpt2", "--device_memory", "lots"], "--device_memory"),
    (["gpt2", "--num_processes", "-1"], "--num_processes"),
    (["no/such/folder"], "no/such/folder"),
    (["gpt2", "--num_machines", "2", "--write", "c.yaml"], "--main_process_ip"),
])
def test_bad_inputs_are_one_line(args, fragment, capsys):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and "Traceback" not in err


# -- sequence (sp, Ulysses) and context (cp) parallelism ----------------------------------------------------------
def test_sequence_layouts_only_for_long_sequences_or_when_asked(llama7b):
    hw = Hardware(num_processes=8)
    short = plan(llama7b, hw, 8, 4096)
    assert all(r["sp_size"] == r["cp_size"] == 1 for r in short["layouts"])
    assert short["sequence_degrees"] == [{"sp_size": 1, "cp_size": 1}]
    long = plan(llama7b, hw, 8, 32768)
    assert {(r["sp_size"], r["cp_size"]) for r in long["layouts"]} >= {(1, 1), (2, 1), (8, 1), (1, 2), (1, 8)}
    assert "sequences of 32768 tokens -> sequence (Ulysses) or context parallelism" in long["explanation"][0]
    best = _best(long)
    assert best["sp_size"] * best["cp_size"] > 1  # 32K tokens of a 7B model: no layout without them fits 80 GB
    assert not any(r["fits"] for r in long["layouts"] if r["sp_size"] == r["cp_size"] == 1 and r["tp_size"] == 1)
    assert any("keep" in line and "tokens of each sequence" in line for line in long["explanation"])
    asked = plan(llama7b, hw, 8, 4096, cp_size=2)
    assert {(r["sp_size"], r["cp_size"]) for r in asked["layouts"]} == {(1, 2)}
    assert any(r["pp_size"] > 1 for r in asked["layouts"])  # pipeline stages compose with cp
    assert {(r["sp_size"], r["cp_size"]) for r in plan(llama7b, hw, 8, 32768, sp_size=1)["layouts"]} == {(1, 1)}


def test_sequence_degree_counts_activations_states_and_traffic(llama7b):
    from accel.planning.plan import activation_bytes, collective, model_shape, sequence_comm

    hw = Hardware(num_processes=8)
    def key(r):
        return r["sp_size"], r["cp_size"], r["zero_stage"], r["tp_size"], r["offload"], r["activation_checkpointing"], \
            r["micro_batches"]

    rows = {key(r): r for r in plan(llama7b, hw, 4, 8192, sp_size=2)["layouts"]}
    plain = {key(r): r for r in plan(llama7b, hw, 4, 8192)["layouts"]}
    sp, one = rows[2, 1, 3, 1, False, "full", 1], plain[1, 1, 3, 1, False, "full", 1]
    assert (sp["dp_size"], one["dp_size"]) == (4, 8) and sp["per_process_batch"] == 1 and one["per_process_batch"] == 0
    # ZeRO-3 shards over dp x sp: the same 8 ranks, the same model states
    assert sp["model_state_bytes_per_rank"] == one["model_state_bytes_per_rank"]
    assert sp["fits"] and not one["fits"]  # 4 samples cannot split over 8 data-parallel ranks; over 4 x sp 2 they do
    shape = model_shape(llama7b, 4096, 32)
    assert activation_bytes(shape, 1, 8192, sp=2) == activation_bytes(shape, 1, 8192) // 2
    cp = activation_bytes(shape, 1, 8192, cp=2)
    assert cp == activation_bytes(shape, 1, 8192) // 2 + shape.layers * 2 * 2 * 8192 * 4096 // 2  # + gathered K/V
    assert sp["time_breakdown_s"]["sequence_parallel"] > 0
    assert plan(llama7b, hw, 8, 8192)["layouts"][0]["time_breakdown_s"]["sequence_parallel"] == 0
    # Ulysses: 4 all-to-alls per layer per forward and as many in backward, each (n-1)/n of this rank's slice
    quiet = Hardware(num_processes=8, intra_latency=0.0)
    tokens, q = 4096, 4096 * 4096 * 2  # this rank's 4096 tokens of q (= k = v = out: no GQA), bf16
    assert sequence_comm(quiet, shape, tokens, 1, 2, 1, 32, "no", 2) == pytest.approx(
        32 * 2 * 4 * q * (2 - 1) / 2 / quiet.intra_bw)
    # context parallelism: all-gathers of K and V forward, reduce-scatters of their gradients backward
    assert sequence_comm(quiet, shape, tokens, 1, 1, 2, 32, "no", 2) == pytest.approx(
        collective(quiet, "all_gather", 32 * 2 * 2 * q, 2, 2)
        + collective(quiet, "reduce_scatter", 32 * 2 * 2 * q, 2, 2))
    with_recompute = sequence_comm(quiet, shape, tokens, 1, 2, 1, 32, "full", 2)
    assert with_recompute == pytest.approx(1.5 * sequence_comm(quiet, shape, tokens, 1, 2, 1, 32, "no", 2))


def test_sequence_layout_is_written_and_launchable(tmp_path):
    result = plan(load_spec("gpt2"), Hardware(num_processes=4, device_memory=16 * GB), 4, 4096, cp_size=2)
    best = _best(result)
    assert best["cp_size"] == 2 and best["dp_size"] * best["tp_size"] * 2 == 4
    saved = yaml.safe_load(write_config(result, tmp_path / "cp.yaml").read_text())
    assert saved["parallelism"]["cp_size"] == 2 and saved["parallelism"]["sp_size"] == 1
    check_launchable(config_from_dict(saved, "cp.yaml"))
    text = "\n".join(result["explanation"])
    assert "CP 2" in text and "keep 2048 tokens of each sequence" in text


@pytest.mark.parametrize("args, fragment", [
    (["--sp_size", "2", "--cp_size", "2"], "--sp_size 2 and --cp_size 2: sequence and context parallelism both"),
    (["--sp_size", "5", "--num_processes", "5"], "--sp_size 5: Ulysses splits the model's 12 attention heads (12 "
                                                 "key/value heads) over the sp ranks; allowed: a divisor of 12"),
    (["--cp_size", "3"], "--cp_size 3: does not divide the 4 processes"),
    (["--sp_size", "0"], "--sp_size 0"),
])
def test_sequence_flags_bad_inputs_are_one_line(args, fragment, capsys):
    assert main(["plan", "gpt2", "--num_processes", "4", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and "Traceback" not in err, err


def test_sequence_column_in_the_text_output(capsys):
    assert main(["plan", "gpt2", "--num_processes", "4", "--batch_size", "4", "--seq_len", "2048", "--sp_size",
                 "2"]) == 0
    out = capsys.readouterr().out
    assert " seq " in out and " sp2 " in out and "SP 2" in out
