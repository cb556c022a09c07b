"""HSDP from Accelerate's fields on 4 CPU processes (gloo), one launch of scripts/hsdp_train.py through the
Accelerate shim: `Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))` trains a
tiny Llama, checked against plain PyTorch on one process: per-step losses (mean over the 4 data-parallel ranks)
and clipped global gradient norms, and the final weights (`save_model`), all within atol 1e-5 (fp32; only the
order of the reductions differs). Also checked: the mesh is (dp_replicate 2, dp_shard 2) with Accelerate's
members; every parameter is a DTensor replicated over dp_replicate and sharded in 2 over dp_shard (each rank
holds half the elements, and both replicas hold equal shards after training); the data loader gives each of
the 4 data-parallel ranks (replicas x shards) its own sample; and the HSDP `save_state` checkpoint, taken after
2 of 4 steps, resumes under another layout (DDP over 4 processes) and ends at the same reference weights."""

import json

import pytest
import torch
from _launch import SCRIPTS, accel_launch, worker_module
from safetensors.torch import load_file

pytestmark = pytest.mark.multiproc
pytest.importorskip("transformers")

ATOL = 1e-5
WORLD = 4


def test_hsdp_matches_one_process_and_resumes_under_ddp(isolated_env, tmp_path):
    env = {**isolated_env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    accel_launch(env, "--accelerate_shim", "--cpu", "--num_processes", WORLD, SCRIPTS / "hsdp_train.py",
                 "--out", tmp_path, timeout=400)
    script = worker_module("hsdp_train")
    ref = script.reference()
    ref_weights = ref["model"].state_dict()
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]

    for rec in records:
        rank = rec["rank"]
        replica, shard = divmod(rank, 2)  # row-major: dp_replicate outer, dp_shard inner
        assert rec["coords"] == {"dp": rank, "dp_replicate": replica, "dp_shard": shard}
        assert rec["data_parallel_rank"] == rank
        assert rec["mesh_dims"] == ["dp_replicate", "dp_shard"] and rec["mesh_local_ranks"] == [replica, shard]
        assert rec["fsdp_mesh_dims"] == ["dp_replicate", "dp_shard_cp"]
        assert rec["config"] == {"zero_stage": 3, "total_size": 4, "data_parallel_size": 4,
                                 "dp_dim_names": ["dp_replicate", "dp_shard"],
                                 "fsdp_dim_names": ["dp_replicate", "dp_shard_cp"],
                                 "dp_shard_enabled": True, "dp_replicate_enabled": True}
        # the data loader shards over all 4 data-parallel ranks: step k's global batch is samples 4k .. 4k+3
        assert rec["samples"] == [[WORLD * step + rank] for step in range(len(ref["losses"]))]
        # the same numbers on every rank: gathered losses and the global norm
        assert torch.allclose(torch.tensor(rec["losses"]), torch.tensor(ref["losses"]), atol=ATOL, rtol=0)
        assert torch.allclose(torch.tensor(rec["norms"]), torch.tensor(ref["norms"]), atol=ATOL, rtol=0)
        # sharded in 2 (Llama's dims are even: exactly half each), replicated across the 2 replicas
        shards = rec["shards"]
        assert shards["all_dtensors"] and shards["layouts_ok"], shards
        assert shards["full_numel"] == sum(p.numel() for p in ref["model"].parameters())
        assert shards["local_numel"] * 2 == shards["full_numel"]
        assert rec["replicas_agree"]
        # resumed under DDP from the HSDP checkpoint at step 2: the remaining steps as in the reference
        resumed = rec["resumed"]
        assert resumed["mesh_dims"] == ["dp_replicate"]
        assert resumed["samples"] == [[WORLD * step + rank] for step in (2, 3)]
        assert torch.allclose(torch.tensor(resumed["losses"]), torch.tensor(ref["losses"][2:]), atol=ATOL, rtol=0)
        assert torch.allclose(torch.tensor(resumed["norms"]), torch.tensor(ref["norms"][2:]), atol=ATOL, rtol=0)

    for folder in ("hsdp_model", "resumed_model"):
        weights = load_file(str(tmp_path / folder / "model.safetensors"))
        assert weights.keys() == ref_weights.keys()
        for key, value in ref_weights.items():
            assert torch.allclose(weights[key], value, atol=ATOL, rtol=0), (folder, key,
                                                                           (weights[key] - value).abs().max())
