"""A small bandwidth-and-launch model of a GPU step (predictions for benchmarks, not measurements).

`predict_seconds` gives the time of a step that moves `dram_bytes` through HBM in `launches`
kernel launches and `torch_ops` other torch calls: the device time at `efficiency` of the peak
bandwidth plus a gap per launch, or the host time to issue the launches, whichever is longer
(the host runs ahead of the device, so the slower of the two sets the pace). Every constant is
a stated assumption, printed next to any number made with it.

`kernel_seconds` is the model of one GEMM-like kernel that re-reads its operands: the slowest of
its tensor-core FLOPs, its HBM bytes and its L2 bytes (every load and store as the kernel issues
them; a re-read whose operand stays L2-resident, `fits_l2`, costs L2 bandwidth, not HBM), plus a
pipeline fill and drain per wave of programs (`waves`) and the launch gap. Its constants
(`Gpu.l2_bytes_per_s`, `GEMM_EFFICIENCY`, `PROGRAM_LATENCY_S`) are stated in
`kernel_assumptions()` and checked against measured H100 times in sparse-kernels'
`tests/test_roofline.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Gpu:
    """Peak HBM bandwidth (vendor datasheet) and SM count of one GPU, and what GEMMs need."""

    name: str
    hbm_bytes_per_s: float
    sms: int
    dense_flops_per_s: float = 0.0
    """Dense bf16 tensor-core peak (datasheet, no 2:4 sparsity)."""
    l2_bytes: float = 0.0
    """L2 capacity."""
    l2_bytes_per_s: float = 0.0
    """L2 bandwidth of a kernel streaming re-reads (an assumption: see `kernel_assumptions`)."""
    shared_bytes_per_sm: int = 0
    """Shared memory per SM (what limits resident programs of pipelined GEMM kernels)."""


#: NVIDIA datasheets and architecture whitepapers: A100 SXM4 80GB 2,039 GB/s, 108 SMs, 312 TFLOP/s
#: dense bf16, 40 MB L2, 164 KB shared memory per SM; H100 SXM5 3.35 TB/s, 132 SMs, 989 TFLOP/s,
#: 50 MB L2, 228 KB shared memory per SM. L2 bandwidth has no datasheet figure. H100: 8.8 TB/s,
#: calibrated: the L2 bytes of the block-sparse forward (bf16, 5120 -> 20480, 4096 tokens, 50%
#: tiles, blocks 128 and 64) over its measured time on an H100 SXM (`shared/research/gpu-h100.md`
#: section 3) are 8.9 and 9.0 TB/s; 8.8 is a round value just below. A100: 5,120 bytes/clock
#: (A100 whitepaper) x 1.41 GHz = 7.2 TB/s peak at the same 85% as HBM, 6.1 TB/s, never checked
#: against a measurement.
A100 = Gpu(
    name="A100-SXM4-80GB", hbm_bytes_per_s=2.039e12, sms=108, dense_flops_per_s=312e12,
    l2_bytes=40e6, l2_bytes_per_s=6.1e12, shared_bytes_per_sm=164 * 1024,
)  # fmt: skip
H100 = Gpu(
    name="H100-SXM5", hbm_bytes_per_s=3.35e12, sms=132, dense_flops_per_s=989e12,
    l2_bytes=50e6, l2_bytes_per_s=8.8e12, shared_bytes_per_sm=228 * 1024,
)  # fmt: skip
GPUS = (A100, H100)

#: Assumptions: streaming kernels reach 85% of peak HBM bandwidth; a launch costs the device
#: 2 us (drain and fill); the host issues a Triton launch in 15 us and a torch op in 6 us.
EFFICIENCY = 0.85
DEVICE_GAP_S = 2e-6
HOST_TRITON_LAUNCH_S = 15e-6
HOST_TORCH_OP_S = 6e-6
#: GEMM kernels reach 70% of the dense tensor-core peak (read off cuBLAS bf16 on the H100 of
#: gpu-h100.md: 654-747 TFLOP/s, 66-76% of 989, at 4096^3 and 4096 x 5120 -> 20480).
GEMM_EFFICIENCY = 0.70
#: A program of a pipelined GEMM kernel waits about two memory round trips that nothing hides:
#: filling its operand pipeline and draining its output tile (~1 us each under load). An
#: estimate, not measured; it matters where programs are short (the 10%-tile forward).
PROGRAM_LATENCY_S = 2e-6


def predict_seconds(
    gpu: Gpu,
    *,
    dram_bytes: float,
    launches: int,
    torch_ops: int,
    efficiency: float = EFFICIENCY,
) -> float:
    """Predicted step time: max(device time, host issue time), in seconds (a model)."""
    device = dram_bytes / (gpu.hbm_bytes_per_s * efficiency) + (launches + torch_ops) * DEVICE_GAP_S
    host = launches * HOST_TRITON_LAUNCH_S + torch_ops * HOST_TORCH_OP_S
    return max(device, host)


def fits_l2(gpu: Gpu, footprint_bytes: float) -> bool:
    """Whether an operand of `footprint_bytes` stays L2-resident while it is re-read."""
    return footprint_bytes <= gpu.l2_bytes


def waves(gpu: Gpu, *, programs: int, shared_bytes: int, threads: int) -> int:
    """Waves of `programs` over the SMs.

    Resident programs per SM are limited by shared memory and by 2,048 threads per SM
    (registers are not modelled).
    """
    per_sm = max(1, min(gpu.shared_bytes_per_sm // max(shared_bytes, 1), 2048 // threads))
    return -(-programs // (per_sm * gpu.sms))


def resource_seconds(
    gpu: Gpu, *, flops: float, hbm_bytes: float, l2_bytes: float, efficiency: float = EFFICIENCY
) -> dict[str, float]:
    """Seconds a kernel's work takes on each resource alone.

    "compute": tensor cores at `GEMM_EFFICIENCY`; "HBM": at `efficiency` of peak; "L2".
    """
    return {
        "compute": flops / (gpu.dense_flops_per_s * GEMM_EFFICIENCY),
        "HBM": hbm_bytes / (gpu.hbm_bytes_per_s * efficiency),
        "L2": l2_bytes / gpu.l2_bytes_per_s,
    }


def kernel_seconds(
    gpu: Gpu,
    *,
    flops: float,
    hbm_bytes: float,
    l2_bytes: float,
    waves: int = 1,
    efficiency: float = EFFICIENCY,
) -> float:
    """Device time of one GEMM-like kernel, in seconds (a model).

    The slowest resource of `resource_seconds`, plus `PROGRAM_LATENCY_S` per wave of programs
    and the launch gap.
    """
    busy = resource_seconds(
        gpu, flops=flops, hbm_bytes=hbm_bytes, l2_bytes=l2_bytes, efficiency=efficiency
    )
    return max(busy.values()) + waves * PROGRAM_LATENCY_S + DEVICE_GAP_S


def kernel_assumptions() -> str:
    """One line stating the constants of `kernel_seconds` (print it with every prediction)."""
    gpus = ", ".join(
        f"{g.name} {g.dense_flops_per_s / 1e12:.0f} TFLOP/s bf16, HBM "
        f"{g.hbm_bytes_per_s / 1e12:.2f} TB/s at {EFFICIENCY:.0%}, L2 {g.l2_bytes / 1e6:.0f} MB "
        f"at {g.l2_bytes_per_s / 1e12:.1f} TB/s"
        for g in GPUS
    )
    return (
        f"model, not a measurement: {gpus}; GEMMs at {GEMM_EFFICIENCY:.0%} of peak; re-reads of "
        f"operands that fit L2 at L2 bandwidth; {PROGRAM_LATENCY_S * 1e6:.0f} us per wave of "
        f"programs; {DEVICE_GAP_S * 1e6:.0f} us per launch; step = max(device, host)"
    )


def assumptions() -> str:
    """One line stating the model's constants (print it with every prediction)."""
    gpus = ", ".join(f"{g.name} {g.hbm_bytes_per_s / 1e9:.0f} GB/s" for g in GPUS)
    return (
        f"model, not a measurement: {gpus}; {EFFICIENCY:.0%} of peak; {DEVICE_GAP_S * 1e6:.0f} us "
        f"device gap per launch/op; host {HOST_TRITON_LAUNCH_S * 1e6:.0f} us per Triton launch, "
        f"{HOST_TORCH_OP_S * 1e6:.0f} us per torch op; step = max(device, host)"
    )


def predict_on_gpus(
    traffic: Callable[..., tuple[dict[str, float], int]], *, launches: int, torch_ops: int
) -> tuple[float, list[float]]:
    """DRAM bytes per element and the predicted step seconds on each of `GPUS`, in order.

    `traffic(gpu=gpu)` gives a step's DRAM bytes per kernel and its element count (it may depend
    on the GPU, e.g. through its SM count); the bytes per element are the last GPU's.
    """
    times = []
    for gpu in GPUS:
        per_kernel, n_el = traffic(gpu=gpu)
        total = sum(per_kernel.values())
        times.append(predict_seconds(gpu, dram_bytes=total, launches=launches, torch_ops=torch_ops))
    return total / n_el, times
