"""The hardware a plan is for: devices per machine, machines, each device's memory, peak FLOP/s, links and the
rates `accel plan --calibrate` measures (accel.planning.measure), and this machine's (`detect`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from accel.planning.inputs import EstimateError

GB = 1e9
EFFICIENCY = 0.5           # achieved / peak FLOP/s of a training step's large matmuls
TOKENS_HALF = 256          # matmul efficiency falls as rows/(rows + TOKENS_HALF) with a micro-batch's tokens
WIDTH_HALF = 128           # ... and as w/(w + WIDTH_HALF) with the hidden size per TP rank
DEFAULT_TFLOPS = 312.0     # peak dense bf16 of an A100; pass --flops for yours
DEFAULT_INTRA_GBS = 150.0  # per-device bandwidth within a machine (NVLink class), GB/s
DEFAULT_INTER_GBS = 25.0   # per-device bandwidth between machines (200 Gb/s InfiniBand class), GB/s
DEFAULT_MEMORY_GBS = 2000.0  # device memory bandwidth (A100 HBM class), GB/s: the memory-bound work's rate
INTRA_LATENCY = 5e-6       # seconds per collective hop within a machine
INTER_LATENCY = 20e-6      # between machines
PCIE_BW = 25 * GB          # host <-> device, bytes/s (offload)
HOST_BW = 20 * GB          # CPU AdamW step: bytes of state touched per second (offload)
DEFAULT_HOST_GB = 1024.0   # host memory per machine for offload




class PlanError(EstimateError):
    """A bad input for `accel plan`: one line for the user."""


@dataclass
class Hardware:
    num_machines: int = 1
    num_processes: int = 1  # per machine
    device_memory: float = 80 * GB
    intra_bw: float = DEFAULT_INTRA_GBS * GB
    inter_bw: float = DEFAULT_INTER_GBS * GB
    flops: float = DEFAULT_TFLOPS * 1e12
    host_memory: float = DEFAULT_HOST_GB * GB
    intra_latency: float = INTRA_LATENCY  # seconds per collective hop
    inter_latency: float = INTER_LATENCY
    tokens_half: float = TOKENS_HALF  # matmul rows at which the rate is half the peak (`--calibrate` measures it)
    width_half: float = WIDTH_HALF
    gather_factor: float = 1.0  # all-gather bus bandwidth / all-reduce's (gloo: ~0.5; `--calibrate` measures it)
    scatter_factor: float = 1.0  # reduce-scatter's (gloo: ~0.35)
    collectives: dict | None = None  # {kind: [[bytes, seconds], ...]} timed by `--calibrate` within a machine
    efficiency: float = EFFICIENCY  # of `flops` a training matmul reaches: a datasheet peak's; 1 for a measured rate
    memory_bw: float = DEFAULT_MEMORY_GBS * GB  # bytes/s of elementwise work (`--calibrate` measures it)
    overlap: float = 1.0  # share of DDP/FSDP2 collectives hidden behind compute (GPU: own stream; gloo ~0.3-0.6)
    sync_fixed: float = 0.0  # seconds a blocking collective adds inside a step beyond its transfer (`--calibrate`)
    sync_slowdown: float = 1.0  # x its isolated time there (caches cold, the other rank's threads busy)
    fsdp_call: float = 0.0  # seconds FSDP2 adds per all-gather/reduce-scatter beyond the transfer (`--calibrate`)
    tp_call: float = 0.0  # seconds DTensor TP adds per collective beyond the transfer (`--calibrate`)
    run_ahead: bool = True  # the host queues work ahead of the device (CUDA), so FSDP2's forward gathers overlap
    op_overhead: float = 0.0  # seconds of framework time per op (forward + backward) the device does not hide
    fp8_flops: float = 0.0  # peak dense fp8 FLOP/s (0: no fp8 math; float8 linears then run at `flops`)
    fused_attention: bool = False  # SDPA runs fused (flash / memory-efficient) kernels: no s x s scores kept
    device: str = ""  # the preset it was built from (accel.planning.devices), "" when none

    @property
    def world(self) -> int:
        return self.num_machines * self.num_processes


def detect() -> Hardware:
    """This machine: its CUDA GPUs (count, memory of the first), else its CPU cores (one process per 4 cores)
    and RAM shared between them, at an assumed 1 TFLOP/s per process."""
    import torch

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if torch.cuda.is_available():
        return Hardware(num_processes=torch.cuda.device_count(),
                        device_memory=torch.cuda.get_device_properties(0).total_memory, host_memory=ram)
    procs = max(1, (os.cpu_count() or 1) // 4)
    # gloo on a CPU as measured on a 2-core machine (`accel plan --calibrate` measures yours)
    return Hardware(num_processes=procs, device_memory=ram / procs, flops=1e12, intra_bw=10 * GB, host_memory=ram,
                    memory_bw=15 * GB, overlap=0.4, sync_fixed=1e-3, op_overhead=1e-5, run_ahead=False,
                    fsdp_call=3e-3, tp_call=5e-3)


def apply_calibration(hw: Hardware, cal: dict, compute: bool = True, links: bool = True) -> list[str]:
    """Set `hw` from a stored `accel plan --calibrate` record (accel.planning.measure.calibrate): the device's rates
    when `compute`, the links within a machine when `links`. What was used, in words."""
    used = []
    if compute and cal.get("flops"):
        hw.flops, hw.efficiency = cal["flops"], 1.0  # a measured matmul rate: already what a matmul reaches
        used.append(f"{cal['flops'] / 1e12:.2f} TFLOP/s")
        if cal.get("tokens_half") is not None:
            hw.tokens_half, hw.width_half = cal["tokens_half"], cal.get("width_half", hw.width_half)
            used.append(f"half rate at {hw.tokens_half:.0f} rows / width {hw.width_half:.0f}")
        if cal.get("memory_bandwidth"):
            hw.memory_bw = cal["memory_bandwidth"]
            used.append(f"memory-bound work {hw.memory_bw / 1e9:.1f} GB/s")
        if cal.get("op_overhead") is not None:
            hw.op_overhead = cal["op_overhead"]
            used.append(f"{hw.op_overhead * 1e6:.0f} us per op")
    if links and cal.get("intra_bandwidth"):
        hw.intra_bw = cal["intra_bandwidth"]
        used.append(f"{hw.intra_bw / 1e9:.2f} GB/s within a machine")
        if cal.get("intra_latency"):
            hw.intra_latency = cal["intra_latency"]
            used.append(f"{hw.intra_latency * 1e6:.0f} us per hop")
        if cal.get("gather_factor"):
            hw.gather_factor, hw.scatter_factor = cal["gather_factor"], cal["scatter_factor"]
            hw.collectives = cal.get("collectives")
            used.append(f"all-gather / reduce-scatter at {hw.gather_factor:.2f} / {hw.scatter_factor:.2f} of it")
        if cal.get("overlap") is not None:
            hw.overlap = cal["overlap"]
            used.append(f"{hw.overlap:.0%} of a collective hidden behind compute")
        if cal.get("sync_fixed") is not None:
            hw.sync_fixed, hw.sync_slowdown = cal["sync_fixed"], cal["sync_slowdown"]
            used.append(f"a blocking collective in a step: {hw.sync_fixed * 1e3:.2f} ms + {hw.sync_slowdown:.2f} x "
                        f"its time alone")
        if cal.get("fsdp_call") is not None:
            hw.fsdp_call, hw.tp_call = cal["fsdp_call"], cal["tp_call"]
            used.append(f"FSDP2 / TP add {hw.fsdp_call * 1e3:.2f} / {hw.tp_call * 1e3:.2f} ms per collective")
    if compute and cal.get("run_ahead") is not None:
        hw.run_ahead = cal["run_ahead"]
    return used
