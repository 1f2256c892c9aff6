"""A small bandwidth-and-launch model of a GPU step (predictions for benchmarks, not measurements).

`predict_seconds` gives the time of a step that moves `dram_bytes` through HBM in `launches`
kernel launches and `torch_ops` other torch calls: the device time at `efficiency` of the peak
bandwidth plus a gap per launch, or the host time to issue the launches, whichever is longer
(the host runs ahead of the device, so the slower of the two sets the pace). Every constant is
a stated assumption, printed next to any number made with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Gpu:
    """Peak HBM bandwidth (vendor datasheet) and SM count of one GPU."""

    name: str
    hbm_bytes_per_s: float
    sms: int


#: NVIDIA datasheets: A100 SXM4 80GB 2,039 GB/s, 108 SMs; H100 SXM5 3.35 TB/s, 132 SMs.
A100 = Gpu(name="A100-SXM4-80GB", hbm_bytes_per_s=2.039e12, sms=108)
H100 = Gpu(name="H100-SXM5", hbm_bytes_per_s=3.35e12, sms=132)
GPUS = (A100, H100)

#: Assumptions: streaming kernels reach 85% of peak HBM bandwidth; a launch costs the device
#: 2 us (drain and fill); the host issues a Triton launch in 15 us and a torch op in 6 us.
EFFICIENCY = 0.85
DEVICE_GAP_S = 2e-6
HOST_TRITON_LAUNCH_S = 15e-6
HOST_TORCH_OP_S = 6e-6


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
