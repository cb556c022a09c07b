"""Worker for tests/multiproc/parallelism/test_hsdp.py, written for Accelerate (run through `accel launch
--accelerate_shim` on 4 CPU processes): HSDP, `ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)`, trains a tiny
Llama for STEPS AdamW steps (clipping, a scheduler, a prepared data loader with one sample per process per step), saves
the training state after SAVE_AT steps and the model at the end. Then a second Accelerator with another layout
(DDP over the 4 processes, `dp_replicate_size=4`) resumes from that checkpoint and finishes the run.

Each rank writes OUT/rank<r>.json (losses, norms, mesh, shard sizes, the samples it read, whether its shards equal
its replica partner's); the test compares them and the saved models with plain PyTorch on one process.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import set_seed
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.data import DataLoader, TensorDataset

STEPS, SAVE_AT, SEQ, VOCAB, LR, MAX_NORM, WORLD = 4, 2, 8, 64, 1e-2, 1.0, 4


def build() -> torch.nn.Module:
    """A tiny Llama (2 layers, grouped-query attention, untied head) from seed 0, fp32."""
    import transformers as tf

    set_seed(0)
    config = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                            num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=16, use_cache=False)
    return tf.LlamaForCausalLM(config)


def samples() -> torch.Tensor:
    """STEPS x WORLD sequences of token ids; step k's global batch is rows WORLD*k .. WORLD*k + WORLD-1."""
    return torch.randint(0, VOCAB, (STEPS * WORLD, SEQ), generator=torch.Generator().manual_seed(7))


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), ids.reshape(-1))


def make_optimizer(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))


def reference() -> dict:
    """Plain PyTorch on one process over the same global batches; the scheduler steps WORLD times per optimizer
    step, as a prepared scheduler does (Accelerate's semantics)."""
    model = build()
    optimizer, scheduler = make_optimizer(model)
    losses, norms, ids = [], [], samples()
    for step in range(STEPS):
        loss = loss_of(model, ids[step * WORLD:(step + 1) * WORLD])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        for _ in range(WORLD):
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"model": model, "losses": losses, "norms": norms}


def train(accelerator, steps: range, record: dict, checkpoint: Path | None = None, save: Path | None = None):
    model = build()
    optimizer, scheduler = make_optimizer(model)
    ids = samples()
    loader = DataLoader(TensorDataset(torch.arange(len(ids)), ids), batch_size=1)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if checkpoint is not None:
        accelerator.load_state(str(checkpoint))
        loader = accelerator.skip_first_batches(loader, steps.start)
    shards = inspect_shards(accelerator, model) if checkpoint is None else None
    for step, (index, batch) in zip(steps, loader):
        loss = loss_of(model, batch)
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        record["samples"].append(index.tolist())
        record["losses"].append(accelerator.gather(loss.detach()[None]).mean().item())
        record["norms"].append(float(norm))
        if save is not None and step + 1 == SAVE_AT:
            accelerator.save_state(str(save))
    return model, shards


def inspect_shards(accelerator, model) -> dict:
    """What this rank holds of each parameter: a DTensor on the 2-D (dp_replicate, dp_shard) mesh, replicated
    over the first dimension and sharded (dim 0) over the second."""
    params = dict(accelerator.unwrap_model(model).named_parameters())
    layouts = {(tuple(p.device_mesh.mesh_dim_names), tuple(p.placements)) for p in params.values()
               if isinstance(p, DTensor)}
    return {
        "all_dtensors": all(isinstance(p, DTensor) for p in params.values()),
        "layouts_ok": layouts == {(("dp_replicate", "dp_shard"), (Replicate(), Shard(0)))},
        "local_numel": sum(p.to_local().numel() for p in params.values()),
        "full_numel": sum(p.numel() for p in params.values()),
    }


def replicas_agree(accelerator, model) -> bool:
    """Each local shard equals the one held by the same dp_shard rank of the other replica (after training)."""
    group = accelerator.torch_device_mesh["dp_replicate"].get_group()
    for param in accelerator.unwrap_model(model).parameters():
        local = param.to_local().detach().contiguous()
        copies = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, local, group=group)
        if any(not torch.equal(copy, copies[0]) for copy in copies[1:]):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)

    # the Accelerate-style entry: HSDP from Accelerate's fields
    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))
    pc, mesh = accelerator.parallelism_config, accelerator.torch_device_mesh
    rank = accelerator.process_index
    coords = accelerator.topology.coordinates(rank)
    record = {
        "rank": rank, "samples": [], "losses": [], "norms": [],
        "coords": {k: coords[k] for k in ("dp", "dp_replicate", "dp_shard")},
        "data_parallel_rank": accelerator.data_parallel_rank,
        "mesh_dims": list(mesh.mesh_dim_names),
        "mesh_local_ranks": [mesh.get_local_rank("dp_replicate"), mesh.get_local_rank("dp_shard")],
        "fsdp_mesh_dims": list(mesh[tuple(pc.fsdp_dim_names)].mesh_dim_names),
        "config": {"zero_stage": pc.zero_stage, "total_size": pc.total_size, "data_parallel_size": pc.data_parallel_size,
                   "dp_dim_names": pc.dp_dim_names, "fsdp_dim_names": pc.fsdp_dim_names,
                   "dp_shard_enabled": pc.dp_shard_enabled, "dp_replicate_enabled": pc.dp_replicate_enabled},
    }
    model, record["shards"] = train(accelerator, range(STEPS), record, save=out / "ckpt")
    record["replicas_agree"] = replicas_agree(accelerator, model)
    accelerator.save_model(model, str(out / "hsdp_model"))

    # another layout resumes the HSDP checkpoint: DDP over all 4 processes
    ddp = Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=WORLD))
    resumed = {"samples": [], "losses": [], "norms": [], "mesh_dims": list(ddp.torch_device_mesh.mesh_dim_names)}
    model, _ = train(ddp, range(SAVE_AT, STEPS), resumed, checkpoint=out / "ckpt")
    ddp.save_model(model, str(out / "resumed_model"))
    record["resumed"] = resumed
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    ddp.end_training()


if __name__ == "__main__":
    main()
