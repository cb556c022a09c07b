"""One command that runs every single-GPU path of accel and prints a table.

    python benchmarks/gpu_check.py                 # on one CUDA GPU, under 8 minutes
    python benchmarks/gpu_check.py --cpu           # the same sections on the CPU, small; CUDA-only ones SKIP
    python benchmarks/gpu_check.py --sections train-bf16,async-save --json out.json

Each section runs in a process of its own (a time limit each; one failure does not stop the others) and ends in
PASS, FAIL, SKIP (what it needs is missing) or REPRODUCED (a defect's old path, run on purpose, failed as it did
before the fix; its fixed path is the section after it):

* train-bf16: a ~1B-parameter transformers Llama from a config (no download), `mixed_precision="bf16"`, AdamW, the
  throughput monitor on: tokens/s, TFLOP/s and MFU per GPU, against torchtitan's published MFU (docs/performance.md:
  Llama 3.1 8B, FSDP on 8 H100s, 33% to 39% MFU, bf16).
* train-fp8: the same with `mixed_precision="fp8"` (torchao float8; SKIP without torchao): tokens/s against bf16.
* compile: `dynamo_backend="inductor"` on a smaller Llama: losses equal eager's (bf16 tolerance), step time ratio.
* activation-checkpointing: `activation_checkpointing="full"`: the same losses, peak memory against off.
* async-save: `save_state(async_save=True)` (pinned staging on CUDA): the first and a later save's blocked time
  against a synchronous save of the same state, and the loaded state equal to the state at the save.
* dispatch: `load_checkpoint_and_dispatch` over GPU, CPU and disk: outputs equal the model's on one device.
* notebook-nvml-old / notebook-gloo-cuda: a parent that asked `torch.cuda.is_available()` without NVML
  forks workers that cannot use CUDA (the old path, REPRODUCED); a parent that asked accel's probe launches 2
  workers with `notebook_launcher`, sharing the GPU over gloo with CUDA tensors (NCCL refuses 2 ranks on one GPU),
  DDP for 3 steps: both ranks end with the same weights.
* offload-clip-nccl-old / offload-clip: FSDP2 with CPU offload on a one-rank group: plain "nccl"
  fails to reduce the offloaded gradients' norm (REPRODUCED); accel's backend for offload ("cuda:nccl,cpu:gloo")
  clips, the norm equal to the unsharded model's.
* meta-offload-old / meta-offload: a meta-device model with a buffer used in forward, FSDP2 with CPU
  offload: materialized all on the CPU, forward fails on CUDA (REPRODUCED); accel's materialization (buffers on the
  GPU) runs, output equal to the same model built on the GPU.
* hang-report: a one-rank NCCL job whose all-reduce never finishes (the stream is held by a long
  kernel), under `accel launch --collective_timeout 15`: what the launcher reports, and whether it names rank 0 and
  the collective (the watchdog kills a NCCL job without a Python exception).

Exit code 1 if any section FAILed.

`--versus` runs benchmarks/versus.py instead (its flags follow): accel against torchtitan 0.3.0 and Accelerate
1.15.0 on the same Llama, the same data and settings, one table of tokens/s, MFU and peak memory (its docstring).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHTITAN_MFU = "33-39% (torchtitan docs/performance.md: Llama 3.1 8B, FSDP, 8 H100, bf16)"
SECTIONS = ["train-bf16", "train-fp8", "compile", "activation-checkpointing", "async-save", "dispatch",
            "notebook-nvml-old", "notebook-gloo-cuda", "offload-clip-nccl-old", "offload-clip", "meta-offload-old",
            "meta-offload", "hang-report"]
CUDA_ONLY = {"train-fp8", "notebook-nvml-old", "notebook-gloo-cuda", "offload-clip-nccl-old", "offload-clip",
             "meta-offload-old", "meta-offload", "hang-report"}
MARK = "GPUCHECK "


# -- helpers run inside a section's process ---------------------------------------------------------------------
def _device(cpu: bool):
    import torch

    return torch.device("cpu") if cpu else torch.device("cuda", 0)


def _llama(cpu: bool, layers: int | None = None, big: bool = True):
    """A Llama from a config: ~1B parameters on a GPU (hidden 2048, 16 layers), tiny on the CPU."""
    from transformers import LlamaConfig

    if cpu:
        return LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=layers or 2, num_attention_heads=4,
                           num_key_value_heads=4, vocab_size=1024, max_position_embeddings=512, use_cache=False,
                           attn_implementation="sdpa")
    if not big:
        return LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers or 8,
                           num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                           max_position_embeddings=2048, use_cache=False, attn_implementation="sdpa")
    return LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers or 16, num_attention_heads=16,
                       num_key_value_heads=16, vocab_size=32000, max_position_embeddings=2048, use_cache=False,
                       attn_implementation="sdpa")


def _batches(cpu: bool, steps: int, vocab: int, batch: int | None = None, seq: int | None = None):
    import torch

    batch = batch or (2 if cpu else 4)
    seq = seq or (64 if cpu else 2048)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (steps * batch, seq), generator=g)
    return [{"input_ids": ids[i * batch:(i + 1) * batch], "labels": ids[i * batch:(i + 1) * batch]}
            for i in range(steps)]


def _train(cpu: bool, steps: int, mixed_precision: str, config, monitor: bool = False, **accelerator_kwargs):
    """Train `steps` steps of a Llama from `config` through accel; returns (losses, seconds per step after 2
    warm-up steps, the monitor's last report, peak memory bytes)."""
    import torch
    from transformers import LlamaForCausalLM

    from accel import Accelerator
    from accel.utils import ThroughputMonitorKwargs, set_seed

    set_seed(0)
    device = _device(cpu)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    handlers = [ThroughputMonitorKwargs(log_every=max(steps - 3, 1))] if monitor else []
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=cpu, kwargs_handlers=handlers, **accelerator_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = torch.utils.data.DataLoader(_batches(cpu, steps, config.vocab_size), batch_size=None)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, start = [], None
    for step, batch in enumerate(loader):
        if step == 2:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    seconds = (time.perf_counter() - start) / max(steps - 2, 1)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    metrics = dict(accelerator.throughput.metrics) if monitor and accelerator.throughput is not None else {}
    accelerator.end_training()
    return losses, seconds, metrics, peak


def _close(a: list[float], b: list[float]) -> float:
    """The largest absolute difference of two loss curves."""
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# -- the sections ------------------------------------------------------------------------------------------------
def train_bf16(cpu: bool) -> dict:
    losses, seconds, metrics, peak = _train(cpu, 6 if cpu else 13, "bf16", _llama(cpu), monitor=True)
    mfu = metrics.get("throughput/mfu_percent")
    return {"status": "PASS" if metrics and all(x == x for x in losses) else "FAIL",
            "tokens_per_s": round(metrics.get("throughput/tokens_per_sec", 0)),
            "tflops": round(metrics.get("throughput/tflops_per_device", 0), 1),
            "mfu_percent": None if mfu is None else round(mfu, 1), "reference_mfu": TORCHTITAN_MFU,
            "step_s": round(seconds, 4), "peak_gb": round(peak / 1e9, 1), "losses": [round(x, 4) for x in losses]}


def train_fp8(cpu: bool) -> dict:
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return {"status": "SKIP", "why": "torchao is not installed (pip install 'accel-train[fp8]')"}
    base = _train(cpu, 13, "bf16", _llama(cpu), monitor=True)
    fp8 = _train(cpu, 13, "fp8", _llama(cpu), monitor=True)
    tokens = fp8[2].get("throughput/tokens_per_sec", 0)
    drift = _close(base[0], fp8[0])
    return {"status": "PASS" if tokens and drift < 0.1 else "FAIL", "tokens_per_s": round(tokens),
            "vs_bf16": round(tokens / max(base[2].get("throughput/tokens_per_sec", 1), 1), 3),
            "loss_diff_vs_bf16": round(drift, 4), "step_s": round(fp8[1], 4)}


def compile_section(cpu: bool) -> dict:
    config = _llama(cpu, layers=1 if cpu else 4, big=False)
    steps = 4 if cpu else 8
    eager = _train(cpu, steps, "bf16", config)
    compiled = _train(cpu, steps, "bf16", config, dynamo_backend="inductor")
    drift = _close(eager[0], compiled[0])
    return {"status": "PASS" if drift < 5e-2 else "FAIL", "loss_diff": round(drift, 5),
            "compiled_vs_eager_step": round(compiled[1] / eager[1], 3)}


def activation_checkpointing(cpu: bool) -> dict:
    from accel import ParallelismConfig

    config = _llama(cpu, layers=2 if cpu else 8, big=False)
    off = _train(cpu, 5, "bf16", config)
    on = _train(cpu, 5, "bf16", config, parallelism_config=ParallelismConfig(activation_checkpointing="full"))
    drift = _close(off[0], on[0])
    ratio = on[3] / off[3] if off[3] else None
    return {"status": "PASS" if drift < 1e-2 and (cpu or (ratio or 1) < 1) else "FAIL", "loss_diff": round(drift, 5),
            "peak_memory_on_vs_off": None if ratio is None else round(ratio, 3),
            "step_on_vs_off": round(on[1] / off[1], 3)}


def async_save(cpu: bool) -> dict:
    import shutil

    import torch
    from transformers import LlamaForCausalLM

    from accel import Accelerator

    from accel.checkpoint import async_save as async_module

    stage = async_module.BackgroundStager._stage

    def stage_reporting(self, state_dict):  # a failure in the staging thread is shown whole, not as one line
        try:
            return stage(self, state_dict)
        except BaseException:
            import traceback

            sys.stderr.write("STAGING FAILED\n" + traceback.format_exc())
            raise

    async_module.BackgroundStager._stage = stage_reporting  # type: ignore[method-assign]
    config = _llama(cpu, layers=2 if cpu else 8, big=False)
    device = _device(cpu)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    accelerator = Accelerator(cpu=cpu)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = _batches(cpu, 1, config.vocab_size, batch=2, seq=128)[0]
    batch = {k: v.to(device) for k, v in batch.items()}

    def step():
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_save_"))
    try:
        sync()
        t0 = time.perf_counter()
        accelerator.save_state(str(folder / "sync"))
        sync()
        sync_s = time.perf_counter() - t0
        from accel.checkpoint.async_save import wait_for_staging

        step_s = []
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            step_s.append(time.perf_counter() - t0)
        plain_step = min(step_s)
        blocked, staging = [], []
        for i in range(2):
            expected = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            sync()
            t0 = time.perf_counter()
            accelerator.save_state(str(folder / f"async{i}"), async_save=True)
            returned = time.perf_counter() - t0
            # the next step: forward and backward run beside the staging copy, the optimizer step waits for it; the
            # parameters then change, and the checkpoint must still hold the state at the save
            step()
            sync()
            blocked.append(time.perf_counter() - t0 - plain_step)  # what the save added to the loop
            staging.append(returned)
            wait_for_staging()
            accelerator.wait_for_checkpoint()  # the write finished: the next save measures its own blocking
        accelerator.load_state(str(folder / "async1"))
        same = all(torch.equal(v.detach().cpu(), expected[k]) for k, v in model.state_dict().items())
    finally:
        accelerator.end_training()
        shutil.rmtree(folder, ignore_errors=True)
    first, later = (max(b, 0.0) / sync_s for b in blocked)
    # PASS: both saves written and the state at the save restored (torch 2.11 failed the second one); the ratios are
    # figures for benchmarks/README.md, not a pass mark (the staging copy's length depends on the model and the link)
    return {"status": "PASS" if same else "FAIL", "sync_save_s": round(sync_s, 3), "step_s": round(plain_step, 3),
            "save_state_returned_s": [round(x, 3) for x in staging],
            "first_async_added_vs_sync": round(first, 3), "later_async_added_vs_sync": round(later, 3),
            "state_at_save_restored": same}


def dispatch(cpu: bool) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from accel.big_modeling import init_empty_weights, load_checkpoint_and_dispatch

    config = _llama(cpu, layers=4, big=False) if not cpu else _llama(cpu, layers=4)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = _batches(True, 1, config.vocab_size, batch=1, seq=32)[0]["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_dispatch_"))
    model.save_pretrained(folder / "model")
    first = 0 if not cpu else "cpu"
    device_map = {"model.embed_tokens": first, "model.layers.0": first, "model.layers.1": "cpu",
                  "model.layers.2": "disk", "model.layers.3": first, "model.norm": first, "model.rotary_emb": first,
                  "lm_head": first}
    with init_empty_weights():  # parameters on meta, buffers (the rotary table) real, as in Accelerate
        empty = LlamaForCausalLM(config).eval()
    dispatched = load_checkpoint_and_dispatch(empty, str(folder / "model"), device_map=device_map,
                                              offload_folder=str(folder / "offload"))
    with torch.no_grad():
        got = dispatched(input_ids=ids.to(_device(cpu))).logits.float().cpu()
    diff = (got - expected).abs().max().item()
    return {"status": "PASS" if diff < 1e-3 else "FAIL", "max_abs_diff": diff, "map": "GPU, CPU, disk"}


NOTEBOOK_WORKER = """
import os, sys, traceback, torch
sys.path.insert(0, {root!r})
_count, _parent = torch._C._cuda_getDeviceCount, os.getpid()
def _reported(*args):  # who asks the CUDA runtime in the parent (which poisons the fork)
    if os.getpid() == _parent:
        sys.stderr.write("CUDA RUNTIME ASKED BY\\n" + "".join(traceback.format_stack(limit=6)[:-1]))
    return _count(*args)
torch._C._cuda_getDeviceCount = _reported
sys.stderr.write(f"NVML COUNT {{torch.cuda._device_count_nvml()}}\\n")
{probe}
from accel import notebook_launcher

def train():
    from accel import Accelerator, InitProcessGroupKwargs
    from accel.utils import set_seed
    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    set_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(accelerator.process_index)
    for _ in range(3):
        x = torch.randn(4, 8, generator=g).to(accelerator.device)
        accelerator.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    weights = accelerator.gather(accelerator.unwrap_model(model).weight.detach().flatten()).view(2, -1)
    if accelerator.is_main_process:
        print("DEVICE", accelerator.device, "SAME", bool(torch.equal(weights[0], weights[1])), flush=True)

notebook_launcher(train, num_processes=2, use_port="29561")
"""


def _notebook(probe: str) -> subprocess.CompletedProcess:
    script = NOTEBOOK_WORKER.format(root=str(ROOT), probe=probe)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)


def notebook_nvml_old(cpu: bool) -> dict:
    out = _notebook("torch.cuda.is_available()  # the old probe: the CUDA runtime initialised before the fork")
    text = out.stdout + out.stderr
    if "Cannot re-initialize CUDA in forked subprocess" in text:
        return {"status": "REPRODUCED", "error": "Cannot re-initialize CUDA in forked subprocess"}
    return {"status": "PASS" if out.returncode == 0 else "FAIL",
            "note": "the old probe did not poison the fork here", "tail": text[-400:]}


def notebook_gloo_cuda(cpu: bool) -> dict:
    out = _notebook("from accel.utils import is_cuda_available; assert is_cuda_available()")
    text = out.stdout + out.stderr
    ok = out.returncode == 0 and "DEVICE cuda" in text and "SAME True" in text
    asked = text[text.find("CUDA RUNTIME ASKED BY"):][:1500] if "CUDA RUNTIME ASKED BY" in text else "nobody"
    return {"status": "PASS" if ok else "FAIL", "cuda_runtime_asked_in_parent_by": asked,
            "nvml": next((li for li in text.splitlines() if li.startswith("NVML COUNT")), "?"),
            "tail": text[-600:] if not ok else "2 workers on cuda:0, gloo"}


ONE_RANK = """
import os, sys, datetime, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT={port!r}, RANK="0", WORLD_SIZE="1")
torch.cuda.set_device(0)
dist.init_process_group({backend!r}, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
"""

CPU_TENSOR = ONE_RANK + """
flag = torch.ones(1)  # a CPU tensor, as FSDP2's offloaded gradient norm and the sharded grad scaler's flag are
dist.all_reduce(flag)
print("CPU_ALL_REDUCE", flag.item(), flush=True)
dist.destroy_process_group()
"""

OFFLOAD_CLIP = ONE_RANK + """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from accel.parallel.gradients import clip_grads_with_norm, total_norm
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
reference = [p.detach().clone() for p in model.parameters()]
fully_shard(model, mesh=init_device_mesh("cuda", (1,)), offload_policy=CPUOffloadPolicy(pin_memory=True))
x = torch.randn(32, 64, device="cuda")
model(x).pow(2).mean().backward()
plain = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
with torch.no_grad():
    for p, r in zip(plain.parameters(), reference):
        p.copy_(r)
plain(x).pow(2).mean().backward()
expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1).item()
grads = [p.grad for p in model.parameters()]
print("GRAD_DEVICE", grads[0].device, flush=True)
norm = total_norm(grads, 2.0, torch.device("cuda", 0))
clip_grads_with_norm(list(model.parameters()), 0.1, norm)
print("NORM", norm.item(), "EXPECTED", expected, flush=True)
dist.destroy_process_group()
"""


def _one_rank(template: str, backend: str, port: str) -> subprocess.CompletedProcess:
    script = template.format(root=str(ROOT), backend=backend, port=port)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)


def offload_clip_nccl_old(cpu: bool) -> dict:
    """One rank: DTensor reduces nothing over a one-rank mesh, so the clip itself passes on plain NCCL; the CPU
    tensor all-reduce that 2 or more ranks do there is run directly."""
    clip = _one_rank(OFFLOAD_CLIP, "nccl", "29571")
    direct = _one_rank(CPU_TENSOR, "nccl", "29573")
    text = direct.stdout + direct.stderr
    found = "No backend type associated with device type cpu" in text
    return {"status": "REPRODUCED" if direct.returncode != 0 and found else "FAIL",
            "cpu_all_reduce_on_nccl": "No backend type associated with device type cpu" if found else text[-300:],
            "one_rank_clip_on_nccl": "ran" if clip.returncode == 0 else (clip.stdout + clip.stderr)[-300:]}


def offload_clip(cpu: bool) -> dict:
    from accel.runtime.state import process_group_backend

    out = _one_rank(OFFLOAD_CLIP, process_group_backend(None, "cuda", True), "29572")
    direct = _one_rank(CPU_TENSOR, process_group_backend(None, "cuda", True), "29574")
    if direct.returncode != 0 or "CPU_ALL_REDUCE 1.0" not in direct.stdout:
        return {"status": "FAIL", "tail": (direct.stdout + direct.stderr)[-800:]}
    text = out.stdout + out.stderr
    line = next((li for li in out.stdout.splitlines() if li.startswith("NORM")), "")
    if out.returncode != 0 or not line:
        return {"status": "FAIL", "tail": text[-800:]}
    norm, expected = float(line.split()[1]), float(line.split()[3])
    return {"status": "PASS" if abs(norm - expected) <= 1e-4 * max(expected, 1) else "FAIL", "norm": norm,
            "unsharded_norm": expected, "backend": process_group_backend(None, "cuda", True)}


META_OFFLOAD = ONE_RANK + """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from accel.backends.recipe import materialize

class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.register_buffer("scale", torch.full((16,), 2.0))
    def reset_parameters(self):
        self.scale.fill_(2.0)
    def forward(self, x):
        return self.linear(x) * self.scale

with torch.device("meta"):
    model = Scaled()
fully_shard(model, mesh=init_device_mesh("cuda", (1,)), offload_policy=CPUOffloadPolicy(pin_memory=True))
{materialize}
torch.manual_seed(0)
x = torch.randn(4, 16, device="cuda")
y = model(x)
print("BUFFER", model.scale.device, "OUT", y.device, flush=True)
dist.destroy_process_group()
"""


def _meta(materialize: str, port: str) -> subprocess.CompletedProcess:
    script = META_OFFLOAD.replace("{materialize}", materialize)
    return _one_rank(script, "cuda:nccl,cpu:gloo", port)


def meta_offload_old(cpu: bool) -> dict:
    out = _meta('materialize(model, "cpu")  # the old path: buffers left on the CPU', "29581")
    text = out.stdout + out.stderr
    if out.returncode != 0 and ("device" in text.lower()):
        last = [li for li in text.splitlines() if "Error" in li][-1:] or [text[-200:]]
        return {"status": "REPRODUCED", "error": last[0][-200:]}
    return {"status": "PASS" if out.returncode == 0 else "FAIL", "note": "the old path ran here", "tail": text[-400:]}


def meta_offload(cpu: bool) -> dict:
    out = _meta('materialize(model, "cpu", buffers_device=torch.device("cuda", 0))', "29582")
    text = out.stdout + out.stderr
    ok = out.returncode == 0 and "BUFFER cuda:0" in text
    return {"status": "PASS" if ok else "FAIL", "tail": text[-600:] if not ok else "buffer on cuda:0, forward ran"}


HANG = """
import datetime, os, torch, torch.distributed as dist
from accel.core.diagnostics import install_worker_hooks
install_worker_hooks(0, 10.0)  # what PartialState installs in a launched worker: records and stacks for the report
torch.cuda.set_device(0)
dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=10), device_id=torch.device("cuda", 0))
x = torch.ones(1, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
torch.cuda._sleep(60_000_000_000)  # ~30 s: the stream is held past the 10 s timeout, the next collective waits
dist.all_reduce(x)
x.item()
"""


def hang_report(cpu: bool) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_hang_"))
    script = folder / "hang.py"
    script.write_text(HANG)
    # one process under torchrun's agent (--log_dir needs it), with accel's hang watch around it
    cmd = [sys.executable, "-m", "accel.cli.main", "launch", "--num_processes", "1", "--collective_timeout", "15",
           "--log_dir", str(folder / "logs"), str(script)]
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired as expired:
        text = (expired.stdout or b"").decode(errors="replace") + (expired.stderr or b"").decode(errors="replace")
        return {"status": "FAIL", "why": "the job did not end within 100 s of a 10 s collective timeout",
                "tail": text[-1500:]}
    seconds = time.perf_counter() - start
    lines = [li for li in (out.stdout + out.stderr).splitlines() if li.startswith("accel launch")]
    named = any("rank 0" in li for li in lines) and any("all_reduce" in li or "collective" in li for li in lines)
    return {"status": "PASS" if out.returncode != 0 and named else "FAIL", "exit_code": out.returncode,
            "seconds": round(seconds, 1), "report": lines[:6] or (out.stdout + out.stderr)[-600:]}


FUNCTIONS = {"train-bf16": train_bf16, "train-fp8": train_fp8, "compile": compile_section,
             "activation-checkpointing": activation_checkpointing, "async-save": async_save, "dispatch": dispatch,
             "notebook-nvml-old": notebook_nvml_old, "notebook-gloo-cuda": notebook_gloo_cuda,
             "offload-clip-nccl-old": offload_clip_nccl_old, "offload-clip": offload_clip,
             "meta-offload-old": meta_offload_old, "meta-offload": meta_offload, "hang-report": hang_report}


# -- the launcher ------------------------------------------------------------------------------------------------
def run_section(name: str, cpu: bool, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, *(["--cpu"] if cpu else [])]
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"status": "FAIL", "why": f"over its {timeout:.0f} s limit", "seconds": timeout}
    record = next((json.loads(li[len(MARK):]) for li in reversed(out.stdout.splitlines()) if li.startswith(MARK)),
                  None)
    if record is None:
        record = {"status": "FAIL", "why": "no result", "tail": (out.stdout + out.stderr)[-3500:]}
    record["seconds"] = round(time.perf_counter() - start, 1)
    return record


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--versus" in argv:  # the other flags go to benchmarks/versus.py
        from versus import main as versus_main

        return versus_main([a for a in argv if a != "--versus"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versus", action="store_true", help="run benchmarks/versus.py instead: accel against "
                        "torchtitan and Accelerate on the same model (its flags follow: --cpu, --configs, --json, ...)")
    parser.add_argument("--cpu", action="store_true", help="small sizes on the CPU; CUDA-only sections SKIP")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--timeout", type=float, default=150, help="seconds per section")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section:
        result = FUNCTIONS[args.section](args.cpu)
        sys.stdout.write(MARK + json.dumps(result, default=str) + "\n")
        return 0
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; run with --cpu for the CPU sections")
        return 0
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in FUNCTIONS]
    if unknown:
        parser.error(f"--sections: unknown {unknown}; allowed: {', '.join(SECTIONS)}")
    results = {}
    where = "CPU" if args.cpu else torch.cuda.get_device_name(0)
    print(f"gpu_check on {where}, torch {torch.__version__}", flush=True)
    for name in chosen:
        if args.cpu and name in CUDA_ONLY:
            results[name] = {"status": "SKIP", "why": "CUDA only"}
        else:
            results[name] = run_section(name, args.cpu, args.timeout)
        shown = {k: v for k, v in results[name].items() if k not in ("status", "tail", "losses")}
        print(f"{name:26} {results[name]['status']:10} {json.dumps(shown, default=str)[:400]}", flush=True)
        if results[name]["status"] == "FAIL" and "tail" in results[name]:
            print(textwrap.indent(str(results[name]["tail"])[-3500:], "    | "), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 1 if any(r["status"] == "FAIL" for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
