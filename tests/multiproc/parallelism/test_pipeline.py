"""Pipeline parallelism on CPU processes against plain PyTorch on one process: per-step losses, clipped global
norms, final weights and eval outputs within atol 1e-5 (fp32, AdamW lr 1e-2). Models: an nn.Sequential and a
GPT-style toy whose head is tied to its embedding (the tie crosses the stages; under the V schedules
ZBVZeroBubble/DualPipeV both ends are on process 0, which runs them as stages 0 and 3).

The runs that succeed share launches: one 2-process and one 4-process launch run their jobs one after another
(pp_train.py --jobs), each job with its own Accelerator and output folder, checked as its own launch would be."""

import json
from pathlib import Path

import pytest
import torch
from _launch import accel_launch, launch_jobs, worker_module
from safetensors.torch import load_file

pytestmark = pytest.mark.multiproc

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pp_train.py"
ATOL = 1e-5


def _worker_module():
    return worker_module("pp_train")


def reference(kind: str, dp: int = 1, steps: int = 4, batch: int = 8, accum: int = 1, dropout: float = 0.0,
              bf16: bool = False):
    """One process, plain PyTorch: dp data-parallel ranks of `batch` = one batch of batch*dp, in order."""
    pp_train = _worker_module()
    model = pp_train.make_model(kind, dropout)
    x, y = pp_train.make_data(kind)
    loss_fn = pp_train.loss_fn_for(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(steps * accum):
        rows = slice(step * batch * dp, (step + 1) * batch * dp)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            outputs = model(x[rows])
        loss = loss_fn(outputs.float(), y[rows])
        (loss / accum).backward()
        losses.append(loss.item())
        if (step + 1) % accum == 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        outputs = model(x[:batch])
        eval_loss = loss_fn(outputs, y[:batch]).item()
    return {"weights": model.state_dict(), "losses": losses, "norms": norms, "outputs": outputs, "eval_loss": eval_loss}


V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # 2 stages per process in V order: process 0 holds stages 0 and 3
SCHEDULES = [(k, s) for s in ("GPipe", "1F1B", "Interleaved1F1B", *V_SCHEDULES) for k in ("seq", "gpt")] + [
    ("gpt", "LoopedBFS"), ("gpt", "InterleavedZeroBubble")]
TWO_PROCESS_JOBS = {  # job -> pp_train.py arguments; run in this order, by one launch
    **{f"{kind}-{schedule}": ["--model", kind, "--schedule", schedule] for kind, schedule in SCHEDULES},
    "split_points": ["--model", "gpt", "--split_points", "layers.1", "--accum", 2, "--steps", 2, "--separate_prepare"],
    "eval_dropout": ["--model", "gpt", "--dropout", 0.5, "--steps", 0],
    "meta": ["--model", "gpt", "--meta"],
    "meta_v": ["--model", "gpt", "--meta", "--schedule", "DualPipeV"],
    "save": ["--model", "gpt", "--save"],
    "load_2_stages": ["--model", "gpt", "--pp_size", 2, "--load", "--ckpt", "{root}/save/ckpt"],
    "load_2_stages_meta": ["--model", "gpt", "--pp_size", 2, "--load", "--ckpt", "{root}/save/ckpt", "--meta"],
    "load_v": ["--model", "gpt", "--schedule", "ZBVZeroBubble", "--load", "--ckpt", "{root}/save/ckpt"],
    "save_v": ["--model", "gpt", "--schedule", "DualPipeV", "--steps", 2, "--save"],
    "load_saved_v": ["--model", "gpt", "--load", "--ckpt", "{root}/save_v/ckpt"],
}
FOUR_PROCESS_JOBS = {
    **{f"dp-zero{stage}": ["--model", "gpt", "--zero_stage", stage] for stage in range(4)},
    "accumulated": ["--model", "gpt", "--accum", 2, "--steps", 2, "--count_reductions"],
    "every_step": ["--model", "gpt", "--steps", 4, "--count_reductions"],
    **{f"dp-{schedule}-zero{stage}": ["--model", "gpt", "--schedule", schedule, "--zero_stage", stage]
       for schedule in ("ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble") for stage in (0, 1)},
    "dp-ZBVZeroBubble-accumulated": ["--model", "gpt", "--schedule", "ZBVZeroBubble", "--accum", 2, "--steps", 2],
}


@pytest.fixture(scope="module")
def two_process_jobs(tmp_path_factory) -> Path:
    from conftest import make_isolated_env

    out = tmp_path_factory.mktemp("pp_jobs_2")
    launch_jobs(out, make_isolated_env(out), 2, SCRIPT, list(TWO_PROCESS_JOBS.items()))
    return out


@pytest.fixture(scope="module")
def four_process_jobs(tmp_path_factory) -> Path:
    from conftest import make_isolated_env

    out = tmp_path_factory.mktemp("pp_jobs_4")
    launch_jobs(out, make_isolated_env(out), 4, SCRIPT, list(FOUR_PROCESS_JOBS.items()))
    return out


def run(isolated_env, tmp_path, num_processes: int, *args, expect: int = 0):
    return accel_launch(isolated_env, "--cpu", "--num_processes", num_processes, SCRIPT, "--out", str(tmp_path),
                        *map(str, args), expect=expect)


def check_against(tmp_path, ref, dp: int = 1, losses_per_rank=None) -> list:
    records = json.loads((tmp_path / "record.json").read_text())
    for rec in records:
        assert torch.allclose(torch.tensor(rec["norms"]), torch.tensor(ref["norms"]), atol=ATOL, rtol=0)
        assert torch.allclose(torch.tensor(rec["eval_outputs"]), ref["outputs"], atol=ATOL, rtol=0)
        assert abs(rec["eval_loss"] - ref["eval_loss"]) < ATOL
        assert rec["metric_rows"] == len(ref["outputs"]) * dp  # gather_for_metrics: each replica's samples once
        if dp == 1:  # the batch loss, the same on every stage
            assert torch.allclose(torch.tensor(rec["losses"]), torch.tensor(ref["losses"]), atol=ATOL, rtol=0)
    if dp > 1:  # each replica's loss is its half of the batch: their mean is the batch loss
        by_replica = torch.tensor([rec["losses"] for rec in records])
        assert torch.allclose(by_replica.mean(0), torch.tensor(ref["losses"]), atol=ATOL, rtol=0)
    weights = load_file(str(tmp_path / "weights.safetensors"))
    assert sorted(weights) == sorted(ref["weights"])  # the original names, every weight once
    for name, value in ref["weights"].items():
        assert torch.allclose(weights[name], value, atol=ATOL, rtol=0), name
    return records


@pytest.mark.parametrize("kind,schedule", SCHEDULES)
def test_schedules_match_one_process(two_process_jobs, kind, schedule):
    records = check_against(two_process_jobs / f"{kind}-{schedule}", reference(kind))
    held = [set(r["param_names"]) for r in records]
    if schedule in V_SCHEDULES:  # V order: process 0 holds stages 0 and 3, so the GPT's tie is local to it
        names = {"seq": ("0.weight", "6.weight"),
                 "gpt": ("embed_tokens.weight", "layers.0.up_proj.weight", "layers.3.up_proj.weight")}[kind]
        assert set(names) <= held[0] and not (held[0] & held[1])
        return
    assert not (held[0] & held[1]) or kind == "gpt"  # disjoint stages (the GPT's tied weight is on both)
    if schedule != "GPipe" and schedule != "1F1B":  # 4 stages, 2 per process: process 0 holds stages 0 and 2
        names = {"seq": ("0.weight", "4.weight"), "gpt": ("layers.0.up_proj.weight", "layers.2.up_proj.weight")}[kind]
        assert set(names) <= held[0]


def test_bf16_autocast(isolated_env, tmp_path):
    """bf16 autocast in every stage, fp32 master weights: losses within 2e-2 of a one-process bf16 run."""
    accel_launch(isolated_env, "--cpu", "--num_processes", 2, "--mixed_precision", "bf16", SCRIPT,
                 "--out", str(tmp_path), "--model", "gpt")
    ref = reference("gpt", bf16=True)
    for rec in json.loads((tmp_path / "record.json").read_text()):
        assert torch.allclose(torch.tensor(rec["losses"]), torch.tensor(ref["losses"]), atol=2e-2, rtol=0)
    assert load_file(str(tmp_path / "weights.safetensors"))["layers.0.up_proj.weight"].dtype == torch.float32


def test_split_points_and_accumulation(two_process_jobs):
    """Also: the model and the optimizer prepared in two calls."""
    records = check_against(two_process_jobs / "split_points", reference("gpt", steps=2, accum=2))
    assert "layers.0.up_proj.weight" in records[0]["param_names"]
    assert "layers.1.up_proj.weight" in records[1]["param_names"]


def test_eval_mode_turns_dropout_off(two_process_jobs):
    check_against(two_process_jobs / "eval_dropout", reference("gpt", steps=0, dropout=0.5))


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3], ids=["ddp", "zero1", "zero2", "zero3"])
def test_pipeline_times_data_parallel(four_process_jobs, zero_stage):
    """4 processes: 2 stages x 2 replicas (DDP, DDP + ZeroRedundancyOptimizer, or FSDP2 for ZeRO 2/3)."""
    check_against(four_process_jobs / f"dp-zero{zero_stage}", reference("gpt", dp=2), dp=2)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble"])
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_split_backward_schedules_times_data_parallel(four_process_jobs, schedule, zero_stage):
    """The zero-bubble schedules compute weight gradients past DDP's hooks: accel averages them over the replicas
    itself (accel/backends/ddp.py), so 2 stages x 2 replicas still equal one process, DDP and ZeRO-1 alike."""
    check_against(four_process_jobs / f"dp-{schedule}-zero{zero_stage}", reference("gpt", dp=2), dp=2)


def test_split_backward_schedule_with_accumulation(four_process_jobs):
    check_against(four_process_jobs / "dp-ZBVZeroBubble-accumulated", reference("gpt", dp=2, steps=2, accum=2), dp=2)


def test_pipeline_times_data_parallel_with_accumulation(four_process_jobs):
    """Gradient accumulation 2 with 2 stages x 2 replicas: inside the window the DDP stages keep gradients
    local, and the accumulated gradients match one process. 4 micro-steps reduce fewer times accumulated
    (2 optimizer steps) than not (4)."""
    accumulated = [r["reductions"] for r in check_against(four_process_jobs / "accumulated",
                                                           reference("gpt", dp=2, steps=2, accum=2), dp=2)]
    every_step = [r["reductions"] for r in json.loads((four_process_jobs / "every_step" / "record.json").read_text())]
    assert all(0 < a < e for a, e in zip(accumulated, every_step)), (accumulated, every_step)


def test_three_d(isolated_env, tmp_path):
    """8 processes: 2 stages x 2 data-parallel replicas x 2 tensor-parallel shards."""
    run(isolated_env, tmp_path, 8, "--model", "gpt-untied", "--tp_size", 2, "--steps", 2)
    check_against(tmp_path, reference("gpt-untied", dp=2, steps=2), dp=2)


def test_checkpoint_across_placements(two_process_jobs):
    """A checkpoint saved under the looped placement loads under a V one (the tied embedding and head both on
    process 0), and one saved under a V schedule loads under 1F1B (each on its own process)."""
    for saved, loaded in (("save", "load_v"), ("save_v", "load_saved_v")):
        trained = load_file(str(two_process_jobs / saved / "weights.safetensors"))
        back = load_file(str(two_process_jobs / loaded / "loaded.safetensors"))
        assert sorted(back) == sorted(trained)
        for name in trained:
            assert torch.equal(back[name], trained[name]), (saved, loaded, name)


def test_checkpoint_loads_unsplit(two_process_jobs, isolated_env, tmp_path):
    """save_state on 2 stages, load_state on one process and on 2 stages (also into a model built on the meta
    device: each process allocates only its stage); save_model loads into the plain model."""
    saved = two_process_jobs / "save"
    trained = load_file(str(saved / "weights.safetensors"))
    run(isolated_env, tmp_path, 1, "--model", "gpt", "--pp_size", 1, "--load", "--ckpt", saved / "ckpt")  # unsplit
    for folder in (tmp_path, two_process_jobs / "load_2_stages", two_process_jobs / "load_2_stages_meta"):
        loaded = load_file(str(folder / "loaded.safetensors"))
        assert sorted(loaded) == sorted(trained)
        for name in trained:
            assert torch.equal(loaded[name], trained[name]), name
    from accel import load_checkpoint_in_model

    model = _worker_module().make_model("gpt")
    load_checkpoint_in_model(model, str(saved / "model"))
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained[name]), name


@pytest.mark.parametrize("args,message", [
    (("--batch", 6, "--microbatches", 4), "batch size 6 is not divisible by pp_microbatches=4"),
    (("--microbatches", 1), "pp_schedule 1F1B with pp_microbatches=1 and 2 stages"),
    (("--outside_loss",), "with pipeline parallelism the backward runs inside `loss = model(inputs, target=targets)`"),
    (("--schedule", "ZBVZeroBubble", "--stages_per_rank", 3),
     "pp_schedule ZBVZeroBubble places exactly 2 stages per process (V shape), got pp_stages_per_rank=3; allowed: 2"),
], ids=["batch-not-divisible", "too-few-microbatches", "backward-of-outside-loss", "v-schedule-stages-per-rank"])
def test_misuse_is_a_clear_error(isolated_env, tmp_path, args, message):
    proc = run(isolated_env, tmp_path, 2, "--model", "seq", *args, expect=1)
    assert message in proc.stderr


def test_transformers_llama_splits_without_stage_code(isolated_env, tmp_path):
    """A tiny LlamaForCausalLM on 2 stages (cut between its decoder layers; its ModelOutput's logits go to
    loss_fn) matches the same model trained on one process, within 1e-5."""
    pytest.importorskip("transformers")
    accel_launch(isolated_env, "--cpu", "--num_processes", 2, SCRIPT.parent / "pp_llama.py", "--out", str(tmp_path))
    result = json.loads((tmp_path / "result.json").read_text())
    assert torch.allclose(torch.tensor(result["losses"]), torch.tensor(result["ref_losses"]), atol=ATOL, rtol=0)
    assert result["names_match"] and result["max_weight_diff"] < ATOL


def test_meta_device_model(two_process_jobs):
    """Built on the meta device, each process allocates and initialises only its stage; the weight tied
    across the stages gets one value (the first stage's) and stays one through training."""
    for job in ("meta", "meta_v"):  # meta_v: DualPipeV, both ends of the tie allocated by process 0
        weights = load_file(str(two_process_jobs / job / "weights.safetensors"))
        assert torch.equal(weights["embed_tokens.weight"], weights["lm_head.weight"]), job
        losses = [rec["losses"] for rec in json.loads((two_process_jobs / job / "record.json").read_text())]
        assert losses[0] == losses[1] and losses[0][-1] < losses[0][0], job
