"""ZeRO stages 1, 2, 3 and 3 with CPU offload on 2 CPU processes, checked against plain PyTorch on one
process: losses, clipped global gradient norms and final weights within atol 1e-5 (fp32); the per-rank
share of parameters (stage 3) and optimizer state (stages >= 1); checkpoints loading on 1 and 2 processes.
"""

import json
from pathlib import Path

import pytest
import torch
from _launch import accel_launch, launch_jobs, worker_module
from safetensors.torch import load_file

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "zero_train.py"
ATOL = 1e-5
N = 2


def launch(isolated_env, num_processes: int, *args: str, prefix: list[str] = ()) -> None:
    accel_launch(isolated_env, "--cpu", "--num_processes", num_processes, *prefix, SCRIPT, *args)


MATCH_CASES = [(1, False, 1, False), (2, False, 2, False), (3, False, 1, False), (3, True, 1, False),
               (1, False, 1, True), (3, False, 1, True)]
MATCH_IDS = ["stage1", "stage2-accum2", "stage3", "stage3-offload", "stage1-separate-prepare", "stage3-separate-prepare"]
TWO_PROCESS_JOBS = [  # (folder, zero_train.py arguments), run in this order by one launch
    *[(name, ["--stage", stage, "--accum", accum, *(["--offload"] if offload else []),
              *(["--separate"] if separate else [])]) for name, (stage, offload, accum, separate) in zip(
        MATCH_IDS, MATCH_CASES, strict=True)],
    *[(f"ckpt{stage}", ["--stage", stage]) for stage in (1, 3)],
    *[(f"ckpt{stage}", ["--stage", stage, "--mode", "load"]) for stage in (1, 3)],  # into the folder saved above
    ("meta", ["--stage", 3, "--mode", "meta"]),
    ("meta-offload", ["--stage", 3, "--mode", "meta", "--offload"]),
    *[(f"fp16-{stage}", ["--stage", stage, "--mode", "fp16"]) for stage in (1, 3)],
]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Path:
    """The runs that succeed, in two launches: 2 processes (every job above), then 1 (the checkpoints loaded)."""
    from conftest import make_isolated_env

    out = tmp_path_factory.mktemp("zero_jobs")
    env = make_isolated_env(out)
    launch_jobs(out, env, N, SCRIPT, TWO_PROCESS_JOBS)
    launch_jobs(out, env, 1, SCRIPT, [(f"ckpt{stage}", ["--stage", stage, "--mode", "load"]) for stage in (1, 3)])
    return out


def reference(accum: int):
    """One process, batch N*accum*4 in the documented order; clip at 0.5; scheduler stepped N times."""
    zero_train = worker_module("zero_train")
    x, y, model = zero_train.make_problem()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
    per_step, losses, norms = N * accum * 4, [], []
    for epoch in range(2):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(x), per_step):
            idx = order[start:start + per_step]
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
            optimizer.step()
            for _ in range(N):
                scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    total_params = sum(p.numel() for p in model.parameters())
    return model.state_dict(), losses, norms, total_params


def assert_weights_equal(weights, ref):
    assert weights.keys() == ref.keys()
    for key, value in ref.items():
        assert torch.allclose(weights[key], value, atol=ATOL, rtol=0), f"{key}: {(weights[key] - value).abs().max()}"


@pytest.mark.parametrize("stage,offload,accum,separate", MATCH_CASES, ids=MATCH_IDS)
def test_zero_matches_single_process_reference(jobs, request, stage, offload, accum, separate):
    tmp_path = jobs / request.node.callspec.id
    records = json.loads((tmp_path / "record.json").read_text())
    ref_weights, ref_losses, ref_norms, total_params = reference(accum)

    assert_weights_equal(load_file(str(tmp_path / "weights.safetensors")), ref_weights)
    micro = torch.tensor(records[0]["losses"])
    assert torch.allclose(micro.reshape(-1, accum * N).mean(dim=1), torch.tensor(ref_losses), atol=ATOL, rtol=0)
    for rec in records:  # clip_grad_norm_ returns the global norm on every rank
        assert torch.allclose(torch.tensor(rec["norms"]), torch.tensor(ref_norms), atol=ATOL, rtol=0)
        assert rec["unwrapped"] in ("Net", "FSDPNet")

    # what each rank holds: AdamW keeps 2 fp32 tensors per parameter
    full_params, full_optimizer = 4 * total_params, 8 * total_params
    optimizer_bytes = [r["optimizer_bytes"] for r in records]
    param_bytes = [r["param_bytes"] for r in records]
    assert sum(optimizer_bytes) == pytest.approx(full_optimizer, rel=0.02)
    assert max(optimizer_bytes) <= 0.6 * full_optimizer  # about 1/N each (ZeRO-1 assigns whole tensors)
    if stage >= 2:
        assert sum(param_bytes) == pytest.approx(full_params, rel=0.02) and max(param_bytes) <= 0.6 * full_params
    else:
        assert param_bytes == [full_params] * N

    # the Hugging Face export holds the full weights too
    from accel import load_checkpoint_in_model

    fresh = worker_module("zero_train").Net()
    load_checkpoint_in_model(fresh, str(tmp_path / "hf_model"), strict=True)
    assert_weights_equal(fresh.state_dict(), ref_weights)


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_checkpoint_loads_on_one_and_two_processes(jobs, stage):
    tmp_path = jobs / f"ckpt{stage}"
    saved = load_file(str(tmp_path / "weights.safetensors"))
    for num_processes in (1, 2):
        assert_weights_equal(load_file(str(tmp_path / f"loaded_{num_processes}.safetensors")), saved)


@pytest.mark.parametrize("folder", ["meta", "meta-offload"])
def test_meta_device_model_is_materialized_after_sharding(jobs, folder):
    """A model created on the meta device (no memory) is sharded, then each rank allocates only its shard; its
    buffers are on the job's device, also under CPU offload (the parameters' shards on the CPU): forward reads them
    next to the computation. The launch runs under the collective-device check, where the job's device is "cpu:0"
    and a host tensor reports "cpu" (on a GPU a buffer left on the CPU fails the first forward)."""
    reports = json.loads((jobs / folder / "meta.json").read_text())
    total = 4 * reference(1)[3]
    assert [r["meta_after_prepare"] for r in reports] == [False, False]
    assert [r["buffer_devices"] for r in reports] == [[r["device"]] for r in reports]
    assert reports[0]["device"] == "cpu:0"  # the check was on
    assert sum(r["param_bytes"] for r in reports) == pytest.approx(total, rel=0.02)
    assert all(r["param_bytes"] <= 0.6 * total for r in reports)
    assert all(torch.isfinite(torch.tensor(r["final_loss"])) for r in reports)


def test_deepspeed_json_config_trains(isolated_env, tmp_path):
    """A DeepSpeed JSON file, without DeepSpeed: stage 2, accumulation 2 and automatic clipping at 0.5 from the
    file; the script neither names the stage nor clips. Ends equal to the single-process reference."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 2, "overlap_comm": True}, "fp16": {"enabled": "auto"}, "steps_per_print": 10,
    }))  # no "optimizer" section: the script builds its torch optimizer (with one, Accelerate's rule asks for DummyOptim)
    launch(isolated_env, N, "--out", str(tmp_path), "--no_clip", prefix=["--deepspeed_config_file", str(ds)])
    records = json.loads((tmp_path / "record.json").read_text())
    assert records[0]["zero_stage"] == 2 and records[0]["gradient_accumulation_steps"] == 2
    assert records[0]["norms"] == []  # the script did not clip; the config did
    ref_weights, *_ = reference(2)
    assert_weights_equal(load_file(str(tmp_path / "weights.safetensors")), ref_weights)


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_inf_step_is_skipped_on_every_rank(jobs, stage):
    """Only rank 1 sees an inf loss; the (sharded) grad scaler makes every rank skip that step together."""
    reports = json.loads((jobs / f"fp16-{stage}" / "fp16.json").read_text())
    for report in reports:
        assert report["skipped"] == [False, True, False, False]
        assert report["changed"] == [True, False, True, True]
        assert report["scaler"] == ("ShardedGradScaler" if stage >= 2 else "GradScaler")
