"""Device presets for `accel plan --device NAME`: each GPU's datasheet figures (dense peak FLOP/s, memory, memory
bandwidth, the link within a machine and the network per GPU of its reference system), turned into a `Hardware`
with the efficiency constants below, the same for every device.

Tensor-core figures are dense: datasheets print the 2:4 sparse figure, twice the dense one, with an asterisk.
Link figures are per direction (NVIDIA prints NVLink's both directions together: 900 GB/s is 450 each way). The
network is what the vendor's 8-GPU reference system gives each GPU (one NIC per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from accel.planning.hardware import GB, Hardware

T = 1e12
# A training step's large bf16 matmuls reach this share of the dense peak: cuBLAS GEMMs of Llama's shapes run at
# 60-70% of an H100 SXM's 989 TFLOP/s alone; inside a step, clocks under the power limit and the kernels
# around them (FSDP2's copies, NCCL's SMs) take a further share. torchtitan reports 33-39% MFU for the whole step
# (benchmarks/llama3_h100_202412_torchtitan.md), which also holds the memory-bound work this model adds apart.
MATMUL_EFFICIENCY = 0.5
# NCCL's bus bandwidth / the link's: nccl-tests reach ~360 GB/s of NVLink 4's 450 per direction on 8 H100s, and
# ~40 GB/s of a 400 Gb/s (50 GB/s) InfiniBand NIC.
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Device:
    name: str
    bf16: float  # dense peak FLOP/s (fp16 the same)
    fp8: float  # dense peak FLOP/s in fp8 (0: no fp8 tensor cores)
    memory: float  # bytes
    memory_bandwidth: float  # bytes/s
    intra: float  # bytes/s per direction to the other GPUs of the machine
    inter: float  # bytes/s per GPU between machines
    source: str

    def hardware(self, num_processes: int = 8, num_machines: int = 1) -> Hardware:
        """The `Hardware` of `num_machines` machines of `num_processes` of these GPUs."""
        return Hardware(num_machines=num_machines, num_processes=num_processes, device_memory=self.memory,
                        flops=self.bf16, fp8_flops=self.fp8, memory_bw=self.memory_bandwidth,
                        intra_bw=self.intra * LINK_EFFICIENCY, inter_bw=self.inter * LINK_EFFICIENCY,
                        efficiency=MATMUL_EFFICIENCY, fused_attention=True, device=self.name)


DEVICES: dict[str, Device] = {d.name: d for d in (
    # https://www.nvidia.com/en-us/data-center/h100/ (datasheet, SXM column): BF16 1,979 / FP8 3,958 TFLOPS sparse,
    # 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s; DGX H100 datasheet: 8 x 400 Gb/s ConnectX-7, one per GPU
    Device("h100-sxm", 989.5 * T, 1979 * T, 80 * GB, 3350 * GB, 450 * GB, 50 * GB,
           "NVIDIA H100 datasheet (SXM), DGX H100 datasheet"),
    # the same datasheet, PCIe column: BF16 1,513 / FP8 3,026 TFLOPS sparse, 80 GB HBM2e at 2.0 TB/s; between 8
    # cards PCIe Gen5 x16, 128 GB/s both ways (NVLink bridges join pairs only); a 400 Gb/s NIC per GPU, as DGX
    Device("h100-pcie", 756.5 * T, 1513 * T, 80 * GB, 2000 * GB, 64 * GB, 50 * GB,
           "NVIDIA H100 datasheet (PCIe)"),
    # https://www.nvidia.com/en-us/data-center/h200/ (SXM column): H100 SXM's tensor cores, 141 GB HBM3e at
    # 4.8 TB/s, NVLink 900 GB/s; DGX H200: 8 x 400 Gb/s ConnectX-7
    Device("h200", 989.5 * T, 1979 * T, 141 * GB, 4800 * GB, 450 * GB, 50 * GB,
           "NVIDIA H200 datasheet (SXM), DGX H200 datasheet"),
    # https://www.nvidia.com/en-us/data-center/a100/ (80GB SXM column): BF16 312 TFLOPS dense, no FP8, 80 GB HBM2e at
    # 2,039 GB/s, NVLink 600 GB/s; DGX A100: 8 x 200 Gb/s HDR InfiniBand
    Device("a100-80gb-sxm", 312 * T, 0.0, 80 * GB, 2039 * GB, 300 * GB, 25 * GB,
           "NVIDIA A100 datasheet (80GB SXM), DGX A100 datasheet"),
    # https://www.nvidia.com/en-us/data-center/dgx-b200/ : 8 GPUs, 72 PFLOPS FP8 training (sparse: 4.5 PF dense FP8
    # and 2.25 PF dense BF16 per GPU), 1,440 GB HBM3e at 64 TB/s (180 GB, 8 TB/s each), NVLink 5 1.8 TB/s per GPU,
    # 8 x 400 Gb/s ConnectX-7
    Device("b200", 2250 * T, 4500 * T, 180 * GB, 8000 * GB, 900 * GB, 50 * GB, "NVIDIA DGX B200 datasheet"),
    # https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html : BF16 1,307.4 / FP8 2,614.9 TFLOPS
    # dense, 192 GB HBM3 at 5.3 TB/s, Infinity Fabric 896 GB/s aggregate (7 links, 448 each way); a 400 Gb/s NIC
    # per GPU as AMD's 8-GPU platform (MI300X platform datasheet) pairs them
    Device("mi300x", 1307.4 * T, 2614.9 * T, 192 * GB, 5300 * GB, 448 * GB, 50 * GB,
           "AMD Instinct MI300X datasheet and platform datasheet"),
)}


def device(name: str) -> Device:
    """The preset called `name` (case and '_' against '-' ignored); KeyError naming the presets."""
    key = name.strip().lower().replace("_", "-")
    if key not in DEVICES:
        raise KeyError(f"{name!r}; allowed: {', '.join(DEVICES)}")
    return DEVICES[key]
