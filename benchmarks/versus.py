"""accel against torchtitan 0.3.0 and Accelerate 1.15.0: the same training, one table.

    python benchmarks/gpu_check.py --versus          # the same as: python benchmarks/versus.py (one GPU, < 8 min)
    python benchmarks/versus.py --cpu                # every peer at toy size on the CPU: the script cannot rot
    python benchmarks/versus.py --configs bf16-eager --peers accel,accelerate --json out.json

What is the same for every peer: a Llama 3 architecture (on a GPU Llama 3.2 1B's dimensions, torchtitan's `llama3`
"1B" flavour: hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocabulary 128256, tied embeddings, Llama 3
RoPE scaling), the same initial weights (a transformers Llama under seed 0, converted for torchtitan by its own
state-dict adapter), the same random tokens, sequence 2048, the global batch (sized by free GPU memory: 4 on an
80 GB H100), AdamW (torchtitan's betas 0.9/0.95, eps 1e-8, weight decay 0.1; fused on CUDA), gradient clipping at
1.0, a constant learning rate, mean next-token cross-entropy, no activation checkpointing. The peers, each in its
own process (a one-rank job):

* accel: this repository's `Accelerator(parallelism_config=ParallelismConfig(zero_stage=3))` on a transformers
  `LlamaForCausalLM` (SDPA attention). With one process accel shards nothing whatever the stage (its data-parallel
  plan is "none"): float32 parameters under bf16 autocast.
* accelerate: Hugging Face Accelerate with `FullyShardedDataParallelPlugin(fsdp_version=2)` (on a GPU: FSDP2 over
  the one rank, bf16 parameters, fp32 gradient reduction), the same model.
* torchtitan: its `Trainer` built from a `Trainer.Config` (its Llama3 model, flex attention, FSDP2 over the one
  rank with bf16 parameters and fp32 reduction, its defaults: CUDA graphs on, compile per block) fed the same tokens
  through a data loader of this script, stepped by its own `train_step`.

Three configs: bf16 eager; bf16 + compile (regional: each decoder block, as torchtitan does); float8 + compile
(torchao's rowwise recipe, torchtitan's default, on every Linear but the output head; SKIP without torchao or a GPU
with float8 matmuls). Each run: warm-up steps (not counted), then a fixed number of steps, each between two
`torch.cuda.synchronize()`; tokens/s from the median step, MFU by torchtitan's formula (6 x non-embedding
parameters + 12 x layers x hidden x sequence FLOPs per token, against the GPU's dense bf16 peak), peak allocated
memory, the spread of the timed steps (min and max against the median), and each peer's ratio to accel. The loss at
step 1 (before any update) must agree within bf16 tolerance, so the comparison is of the same work.

A peer whose package is missing is a SKIP that says so; `benchmarks/fetch_versus_wheels.sh` downloads torchtitan,
Accelerate and the pure-Python packages they import into benchmarks/wheels/ (no torch), and this script installs the
ones this Python lacks into benchmarks/wheels/site before it starts (offline: `pip install --no-index --no-deps`).
On a CPU torchtitan's Trainer takes "cuda" for its device (torch names no accelerator there): it runs with a stand-in
for the device module (names, memory statistics), and with SDPA in place of flex attention, which has no backward on
a CPU (one document per row, so the same causal attention); `datasets`, `triton` and `tensorboard`, imported by
torchtitan but unused here, get stand-ins where absent. Its record's setup says what ran.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WHEELS = HERE / "wheels"
SITE = WHEELS / "site"
PEERS = ["accel", "torchtitan", "accelerate"]
CONFIGS = {"bf16-eager": {"float8": False, "compile": False},
           "bf16-compile": {"float8": False, "compile": True},
           "float8-compile": {"float8": True, "compile": True}}
LLAMA_1B = {"dim": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "ffn": 8192, "vocab": 128256}  # torchtitan "1B"
TOY = {"dim": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 256, "vocab": 512}
PACKAGE = {"accel": "accel", "accelerate": "accelerate", "torchtitan": "torchtitan"}
PINNED = {"torchtitan": "0.3.0", "accelerate": "1.15.0"}  # installed from the wheels when another version is here
BYTES_PER_TOKEN = 4.5e6  # activations + logits of the 1B model per token, no checkpointing (fp32 logits copies)


# -- the peers' packages ----------------------------------------------------------------------------------------
def install_wheels(wheels: Path = WHEELS, site: Path = SITE) -> list[str]:
    """Install into `site`, without the network and without dependencies, each wheel of `wheels` whose package
    this Python lacks or has at an older version (torchtitan and Accelerate: at another version)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    wanted = []
    for wheel in sorted(wheels.glob("*.whl")):
        name, wheel_version = wheel.name.split("-")[:2]
        try:
            have = version(name.replace("_", "-"))
        except PackageNotFoundError:
            have = None
        if (site / f"{name}-{wheel_version}.dist-info").exists():
            continue
        if have is None or (name in PINNED and have != wheel_version) or Version(have) < Version(wheel_version):
            wanted.append(wheel)
    if wanted:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--upgrade",
                        "--target", str(site), *map(str, wanted)], check=True)
    return [w.name for w in wanted]


def missing_package(peer: str, site: Path | None) -> str | None:
    """Why `peer` cannot run here (its package is not installed), or None."""
    import importlib.util

    if site is not None and str(site) not in sys.path:
        sys.path.insert(0, str(site))
    package = PACKAGE[peer]
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed (bash benchmarks/fetch_versus_wheels.sh, then rerun)"
    return None


# -- sizes and the FLOPs of one token ---------------------------------------------------------------------------
def flops_per_token(model: dict, seq: int) -> float:
    """torchtitan's formula: 6 x the parameters that multiply (every block, the output head) + 12 x l x h x s."""
    dim, ffn, heads, kv = model["dim"], model["ffn"], model["heads"], model["kv_heads"]
    head_dim = dim // heads
    block = dim * dim * 2 + 2 * dim * kv * head_dim + 3 * dim * ffn + 2 * dim
    dense = model["layers"] * block + dim + dim * model["vocab"]
    return 6 * dense + 12 * model["layers"] * dim * seq


def parameters(model: dict) -> int:
    dim, heads, kv = model["dim"], model["heads"], model["kv_heads"]
    block = dim * dim * 2 + 2 * dim * kv * (dim // heads) + 3 * dim * model["ffn"] + 2 * dim
    return model["layers"] * block + dim + dim * model["vocab"]  # tied: the embedding is the output head


def dense_bf16_peak(name: str) -> float | None:
    """The GPU's dense bf16 peak FLOP/s (accel's table; H100 and H200 SXM: 989 TFLOP/s), the denominator of MFU for
    every config, float8 included (as torchtitan reports it)."""
    try:
        from accel.planning.peak_flops import gpu_peak
    except ImportError:  # the table moved: the GPUs this comparison is planned for
        return next((peak for key, peak in (("H100", 989.5e12), ("H200", 989.5e12), ("A100", 312e12))
                     if key in name), None)
    return gpu_peak(name, "bf16")


def gpu_facts() -> dict:
    """Free memory, name and float8 support of GPU 0, asked in a short process of its own (this one stays off
    the GPU, so every peer finds it as the last one left it)."""
    code = ("import json, torch; free, total = torch.cuda.mem_get_info(); "
            "print(json.dumps({'free': free, 'total': total, 'name': torch.cuda.get_device_name(0), "
            "'capability': torch.cuda.get_device_capability(0)}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def batch_for(free_bytes: float, model: dict, seq: int) -> int:
    """The largest of 8, 4, 2, 1 sequences whose activations and AdamW state (16 bytes a parameter) fit in 85% of
    the free memory."""
    room = 0.85 * free_bytes - 16 * parameters(model)
    for batch in (8, 4, 2, 1):
        if batch * seq * BYTES_PER_TOKEN <= room:
            return batch
    return 1


# -- running one peer -------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(spec: dict, folder: Path, timeout: float) -> dict:
    """One peer (or the preparation) in a process of its own, as one rank of a one-process job."""
    name = f"{spec['peer']}-{spec.get('config_name', 'prepare')}"
    spec_path, out_path = folder / f"{name}.json", folder / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": os.pathsep.join(p for p in [str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")] if p)}
    if spec["cpu"]:
        env.setdefault("OMP_NUM_THREADS", "1")
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-c", "import sys, _versus_peers; _versus_peers.worker(sys.argv[1], sys.argv[2])",
           str(spec_path), str(out_path)]
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=folder)
    except subprocess.TimeoutExpired as expired:
        tail = (expired.stderr or b"")
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"status": "FAIL", "why": f"over its {timeout:.0f} s limit", "tail": tail[-1500:]}
    seconds = time.perf_counter() - start
    if out.returncode != 0 or not out_path.exists():
        return {"status": "FAIL", "why": f"exit {out.returncode}", "tail": (out.stdout + out.stderr)[-2500:],
                "wall_s": round(seconds, 1)}
    record = json.loads(out_path.read_text())
    record.update(status="PASS", wall_s=round(seconds, 1))
    return record


def summarize(record: dict, spec: dict, flops: float, peak_flops: float | None) -> dict:
    """Tokens/s from the median timed step, MFU, peak memory and the spread of the timed steps."""
    timed = sorted(record["seconds"][spec["warmup"]:])
    median = timed[len(timed) // 2] if len(timed) % 2 else sum(timed[len(timed) // 2 - 1:len(timed) // 2 + 1]) / 2
    tokens = spec["batch"] * spec["seq"] / median
    return {**record, "median_s": median, "tokens_per_s": tokens,
            "mfu": tokens * flops / peak_flops if peak_flops else None,
            "spread": (timed[0] / median - 1, timed[-1] / median - 1), "loss1": record["losses"][0]}


# -- the table --------------------------------------------------------------------------------------------------
def table(results: dict, tolerance: dict) -> list[str]:
    lines = [f"{'config':15} {'peer':12} {'status':6} {'tokens/s':>10} {'MFU':>6} {'peak GB':>8} {'x accel':>8} "
             f"{'mem x accel':>11} {'step ms':>8} {'spread (min/max)':>17} {'loss@1':>9} {'|dloss1|':>8}"]
    for config, peers in results.items():
        base = peers.get("accel", {})
        for peer, r in peers.items():
            if r["status"] != "PASS":
                lines.append(f"{config:15} {peer:12} {r['status']:6} {r.get('why', '')}")
                continue
            ratio = (f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}" if base.get("status") == "PASS" else "-")
            mem = (f"{r['peak_bytes'] / base['peak_bytes']:.3f}"
                   if base.get("status") == "PASS" and base["peak_bytes"] else "-")
            dloss = abs(r["loss1"] - base["loss1"]) if base.get("status") == "PASS" else None
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
            same = "" if dloss is None else f"{dloss:8.4f}" + ("" if dloss <= tolerance[config] else " DIFFERS")
            peak = f"{r['peak_bytes'] / 1e9:.2f}" if r["peak_bytes"] else "-"
            lines.append(f"{config:15} {peer:12} {'PASS':6} {r['tokens_per_s']:10.0f} {mfu:>6} "
                         f"{peak:>8} {ratio:>8} {mem:>11} {1000 * r['median_s']:8.1f} "
                         f"{100 * r['spread'][0]:+7.1f}%/{100 * r['spread'][1]:+6.1f}% {r['loss1']:9.4f} {same}")
    return lines


def same_work(results: dict, tolerance: dict) -> bool:
    """Every peer's step-1 loss within the config's tolerance of accel's."""
    ok = True
    for config, peers in results.items():
        losses = [r["loss1"] for r in peers.values() if r["status"] == "PASS"]
        if len(losses) > 1 and max(losses) - min(losses) > tolerance[config]:
            ok = False
    return ok


# -- main -------------------------------------------------------------------------------------------------------
def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="toy size on the CPU (gloo); float8 SKIPs")
    parser.add_argument("--configs", help=f"comma-separated subset of {list(CONFIGS)} (default: all; CPU: bf16-eager, "
                        "as compiling every peer takes minutes on 2 cores)")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {PEERS}")
    parser.add_argument("--warmup", type=int, help="steps not timed (default: GPU 3, CPU 1)")
    parser.add_argument("--steps", type=int, help="timed steps after the warm-up (default: GPU 10, CPU 2)")
    parser.add_argument("--seq", type=int, help="sequence length (default: GPU 2048, CPU 32)")
    parser.add_argument("--batch", type=int, help="global batch (default: GPU from free memory, CPU 2)")
    parser.add_argument("--budget", type=float, default=450, help="seconds for the whole comparison; peers that "
                        "would start past it SKIP")
    parser.add_argument("--titan-cuda-graphs", choices=("on", "off"), default="on",
                        help="torchtitan's training.disable_cuda_graphs the other way round (its default: on)")
    parser.add_argument("--site", type=Path, default=SITE, help="where the peers' wheels are installed")
    parser.add_argument("--json", help="also write the results to this file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    chosen = args.configs or ("bf16-eager" if args.cpu else ",".join(CONFIGS))
    configs = [c.strip() for c in chosen.split(",") if c.strip()]
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    bad = [c for c in configs if c not in CONFIGS] + [p for p in peers if p not in PEERS]
    if bad:
        print(f"versus: unknown {bad}; configs: {list(CONFIGS)}, peers: {PEERS}")
        return 2
    started = time.perf_counter()
    installed = install_wheels(WHEELS, args.site) if any(WHEELS.glob("*.whl")) else []
    import torch

    cpu = args.cpu
    if not cpu and not torch.cuda.is_available():
        print("versus: no CUDA GPU here; run with --cpu for the toy-size run")
        return 0
    facts = None if cpu else gpu_facts()
    model = TOY if cpu else LLAMA_1B
    seq = args.seq or (32 if cpu else 2048)
    batch = args.batch or (2 if cpu else batch_for(facts["free"], model, seq))
    spec_base = {"cpu": cpu, "model": model, "seq": seq, "batch": batch, "lr": 3e-4,
                 "warmup": args.warmup if args.warmup is not None else (1 if cpu else 3),
                 "steps": args.steps or (2 if cpu else 10), "site": str(args.site) if args.site.exists() else None,
                 "titan_cuda_graphs": args.titan_cuda_graphs == "on"}
    flops = flops_per_token(model, seq)
    peak_flops = None
    where = "CPU"
    if not cpu:
        peak_flops = dense_bf16_peak(facts["name"])
        where = f"{facts['name']} ({facts['free'] / 2**30:.0f} of {facts['total'] / 2**30:.0f} GiB free)"
    print(f"versus on {where}, torch {torch.__version__}: Llama of {parameters(model):,} parameters "
          f"({'toy' if cpu else 'torchtitan llama3 1B'}), seq {seq}, global batch {batch}, warm-up "
          f"{spec_base['warmup']} + {spec_base['steps']} timed steps, {flops / 1e9:.2f} GFLOP/token"
          + (f"; installed from benchmarks/wheels: {', '.join(installed)}" if installed else ""), flush=True)
    tolerance = {"bf16-eager": 0.05, "bf16-compile": 0.05, "float8-compile": 0.1}
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="versus_") as tmp:
        folder = Path(tmp)
        spec_base.update(weights=str(folder / "weights.safetensors"), tokens=str(folder / "tokens.pt"),
                         dump_folder=str(folder / "titan"))
        prepared = run_worker({**spec_base, "peer": "prepare"}, folder, 300)
        if prepared["status"] != "PASS":
            print("versus: preparing the weights and tokens failed\n" + prepared.get("tail", ""))
            return 1
        for config in configs:
            results[config] = {}
            for peer in peers:
                why = skip_reason(peer, config, cpu, facts, args.site)
                left = args.budget - (time.perf_counter() - started)
                limit = (300 if cpu else 140) if CONFIGS[config]["compile"] else (90 if cpu else 100)
                if why is None and left < 0.6 * limit:
                    why = f"{left:.0f} s left of the {args.budget:.0f} s budget (rerun with --configs {config})"
                if why is not None:
                    results[config][peer] = {"status": "SKIP", "why": why}
                    continue
                spec = {**spec_base, "peer": peer, "config_name": config, "config": CONFIGS[config]}
                record = run_worker(spec, folder, min(limit, left))
                if record["status"] == "PASS":
                    record = summarize(record, spec, flops, peak_flops)
                results[config][peer] = record
                r = record
                shown = (f"{r['tokens_per_s']:.0f} tokens/s, loss@1 {r['loss1']:.4f}, {r['wall_s']} s; {r['setup']}"
                         if r["status"] == "PASS" else f"{r['why']}\n{r.get('tail', '')}")
                print(f"  {config:15} {peer:12} {r['status']}: {shown}", flush=True)
    print()
    print("\n".join(table(results, tolerance)))
    agree = same_work(results, tolerance)
    print(f"\nstep-1 losses {'agree' if agree else 'DIFFER'} (tolerance: bf16 {tolerance['bf16-eager']}, float8 "
          f"{tolerance['float8-compile']}); spread: the fastest and slowest timed step against the median; "
          f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"spec": spec_base, "results": results}, indent=1, default=str))
    failed = any(r["status"] == "FAIL" for peers_ in results.values() for r in peers_.values())
    return 1 if failed or not agree else 0


def skip_reason(peer: str, config: str, cpu: bool, facts: dict | None, site: Path) -> str | None:
    import importlib.util

    why = missing_package(peer, site if site.exists() else None)
    if why:
        return why
    if CONFIGS[config]["float8"]:
        if cpu:
            return "float8 needs a GPU with float8 matmuls (torchtitan refuses torchao's emulation under compile)"
        if importlib.util.find_spec("torchao") is None:
            return "torchao is not installed (pip install 'accel-train[fp8]')"
        if facts is not None and tuple(facts["capability"]) < (8, 9):
            return f"{facts['name']} has no float8 matmuls (compute capability 8.9+)"
    return None


if __name__ == "__main__":
    sys.exit(main())
