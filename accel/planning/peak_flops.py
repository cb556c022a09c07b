"""A device's peak FLOP/s, the denominator of the throughput monitor's MFU (accel/runtime/throughput.py).

GPUs: the vendor's datasheet figure for dense matrix math (no 2:4 sparsity: datasheets print the sparse figure, twice
the dense one, with an asterisk), per precision: `bf16` (fp16 is the same rate on every GPU listed), `fp8`, `tf32`
(fp32 matmuls when torch allows TF32) and `fp32` (plain fp32 math). A GPU not in the table has no peak (MFU is not
reported) unless the user gives one (`ThroughputMonitorKwargs(peak_flops=...)`).

CPUs have no datasheet figure worth trusting (it depends on the cores and threads the process gets, AVX-512/AMX, the
clock under load): the peak is measured once with a matmul (accel.planning.measure.matmul_tflops, the rate `accel
plan --calibrate` measures) and cached in `$XDG_CACHE_HOME/accel/peak_flops.json` (else `~/.cache/accel/`), keyed by
the CPU model, torch's thread count, the dtype and the torch version.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path

T = 1e12

# name pattern (matched in torch.cuda.get_device_name(), first match wins: specific before generic) ->
# {precision: dense peak FLOP/s}
GPU_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    # H100 / H200: https://www.nvidia.com/en-us/data-center/h100/ and .../h200/ (datasheet tables: SXM, NVL, PCIe
    # columns; tensor-core figures "with sparsity", halved here). SXM: FP32 67, TF32 989/2, BF16 1979/2, FP8 3958/2.
    ("H100 NVL", {"fp32": 60 * T, "tf32": 835 * T / 2, "bf16": 1671 * T / 2, "fp8": 3341 * T / 2}),
    ("H100 PCIe", {"fp32": 51 * T, "tf32": 756 * T / 2, "bf16": 1513 * T / 2, "fp8": 3026 * T / 2}),
    ("H200 NVL", {"fp32": 60 * T, "tf32": 835 * T / 2, "bf16": 1671 * T / 2, "fp8": 3341 * T / 2}),
    ("H100", {"fp32": 67 * T, "tf32": 989 * T / 2, "bf16": 1979 * T / 2, "fp8": 3958 * T / 2}),
    ("H200", {"fp32": 67 * T, "tf32": 989 * T / 2, "bf16": 1979 * T / 2, "fp8": 3958 * T / 2}),  # GH200 too
    ("H800", {"fp32": 67 * T, "tf32": 989 * T / 2, "bf16": 1979 * T / 2, "fp8": 3958 * T / 2}),  # H100 SXM's math
    # B200 (HGX B200, per GPU): https://www.nvidia.com/en-us/data-center/hgx/ : TF32 2.2 PF, BF16 4.5 PF, FP8 9 PF
    # (sparse; halved), FP32 75 TF
    ("B200", {"fp32": 75 * T, "tf32": 1100 * T, "bf16": 2250 * T, "fp8": 4500 * T}),
    # A100 (SXM and PCIe alike): https://www.nvidia.com/en-us/data-center/a100/ : FP32 19.5, TF32 156, BF16 312 (dense)
    ("A100", {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T}),
    # A10 / A10G: https://www.nvidia.com/en-us/data-center/products/a10-gpu/ : FP32 31.2, TF32 62.5, BF16 125 (dense)
    ("A10", {"fp32": 31.2 * T, "tf32": 62.5 * T, "bf16": 125 * T}),
    # L40S: https://www.nvidia.com/en-us/data-center/l40s/ : FP32 91.6, TF32 183, BF16 362.05, FP8 733 (dense)
    ("L40S", {"fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362.05 * T, "fp8": 733 * T}),
    # L40: https://www.nvidia.com/en-us/data-center/l40/ : FP32 90.5, TF32 181/2, BF16 362.1/2, FP8 724/2
    ("L40", {"fp32": 90.5 * T, "tf32": 90.5 * T, "bf16": 181 * T, "fp8": 362 * T}),
    # L4: https://www.nvidia.com/en-us/data-center/l4/ : FP32 30.3, TF32 120/2, BF16 242/2, FP8 485/2
    ("L4", {"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp8": 242.5 * T}),
    # V100 SXM2 / PCIe: https://www.nvidia.com/en-us/data-center/v100/ : tensor FP16 125 / 112, FP32 15.7 / 14 (no
    # bf16, no tf32: fp16 is what its tensor cores run)
    ("V100-SXM", {"fp32": 15.7 * T, "tf32": 15.7 * T, "bf16": 125 * T}),
    ("V100", {"fp32": 14 * T, "tf32": 14 * T, "bf16": 112 * T}),
    # MI300X: https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html : FP32 163.4 (matrix), TF32 653.7,
    # BF16 1307.4, FP8 2614.9 (dense)
    ("MI300X", {"fp32": 163.4 * T, "tf32": 653.7 * T, "bf16": 1307.4 * T, "fp8": 2614.9 * T}),
)

PRECISIONS = ("fp32", "tf32", "bf16", "fp8")
CACHE_NAME = "peak_flops.json"


def precision_of(mixed_precision: str, cuda: bool) -> str:
    """The table's precision a training step's matmuls run in: bf16 for bf16/fp16, fp8 for fp8, else fp32 (tf32 on
    CUDA when torch allows TF32 matmuls: `torch.backends.cuda.matmul.allow_tf32`)."""
    if mixed_precision in ("bf16", "fp16"):
        return "bf16"
    if mixed_precision == "fp8":
        return "fp8"
    if cuda:
        import torch

        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    return "fp32"


def gpu_peak(name: str, precision: str) -> float | None:
    """The table's dense peak FLOP/s of GPU `name` at `precision`; None when the GPU (or that precision on it) is not
    in the table. fp8 falls back to bf16 on a GPU without fp8 math (what torchao's float8 runs there, if anything)."""
    for pattern, peaks in GPU_PEAKS:
        if pattern.lower() in name.lower():
            return peaks.get(precision) or (peaks.get("bf16") if precision == "fp8" else None)
    return None


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "accel" / CACHE_NAME


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform says."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown cpu"


def cpu_key(dtype_name: str) -> str:
    import torch

    return f"{cpu_model()} | threads={torch.get_num_threads()} | {dtype_name} | torch {torch.__version__}"


_DTYPES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp8": "bfloat16"}


def measure_cpu_peak(dtype_name: str) -> float:
    """FLOP/s of a 1024 x 1024 matmul in `dtype_name` on this process's CPU threads (the best of a few timings)."""
    import torch

    from accel.planning.measure import matmul_tflops

    return matmul_tflops("cpu", getattr(torch, dtype_name), 1024, 4) * T


def cpu_peak(precision: str, path: Path | None = None) -> tuple[float, bool]:
    """This CPU's matmul rate at `precision`, from the cache when it holds one for this CPU, thread count, dtype and
    torch; else measured (about 0.3 s) and written there. Returns (FLOP/s, whether it was measured now). A cache that
    cannot be read is measured over; one that cannot be written is left alone (measured again next time)."""
    path = path or cache_path()
    dtype_name = _DTYPES.get(precision, "float32")
    key = cpu_key(dtype_name)
    entries: dict = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads(path.read_text())
        entries = loaded if isinstance(loaded, dict) else {}
    cached = entries.get(key)
    if isinstance(cached, dict) and isinstance(cached.get("flops"), (int, float)) and cached["flops"] > 0:
        return float(cached["flops"]), False
    flops = measure_cpu_peak(dtype_name)
    entries[key] = {"flops": flops, "measured": time.time()}
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".peak-", suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(entries, handle, indent=1)
            os.replace(tmp, path)  # atomic: ranks measuring at once each leave a whole file
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return flops, True


def device_peak(device, mixed_precision: str) -> tuple[float | None, str]:
    """(peak FLOP/s of `device` for a step in `mixed_precision`, where it came from); (None, why) when unknown."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        precision = precision_of(mixed_precision, cuda=True)
        peak = gpu_peak(name, precision)
        if peak is None:
            return None, f"{name} is not in accel's table of GPU peaks (give ThroughputMonitorKwargs(peak_flops=...))"
        return peak, f"{name} {precision} datasheet"
    if device.type == "cpu":
        precision = precision_of(mixed_precision, cuda=False)
        flops, _ = cpu_peak(precision)
        return flops, f"CPU {_DTYPES.get(precision, 'float32')} matmul, measured"
    return None, f"no peak known for {device.type} devices (give ThroughputMonitorKwargs(peak_flops=...))"
