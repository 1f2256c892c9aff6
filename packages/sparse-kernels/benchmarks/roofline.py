"""GPU benchmark points of bench_sparse.py and their predicted roofline times.

For each point the FLOPs and the bytes every kernel moves are counted from its launch
configuration (`sparse_kernels._bsr_launch.kernel_config` / `sdd_splits`, the same functions
the launchers use), and the predicted time is `max(FLOPs / peak, bytes / bandwidth)`, printed
beside the measured time so the first GPU run is checked against a prediction.

Assumptions (state them with the numbers):

* Peaks are the dense bf16 tensor-core rate and the HBM bandwidth of the datasheets: A100 SXM4
  80 GB 312 TFLOP/s, 2.0 TB/s (NVIDIA A100 datasheet: 1,935 GB/s PCIe / 2,039 GB/s SXM);
  H100 SXM 989 TFLOP/s, 3.35 TB/s (NVIDIA H100 datasheet; 1,979 TFLOP/s is the 2:4 sparse
  rate, used for the 2:4 rows). Other devices get no prediction.
* Bytes count every global load and store of the kernel as written (no L2 reuse), e.g. the
  forward re-reads a stored tile once per BLOCK_M token tile; the dense anchor counts each
  operand once (cuBLAS tiles reuse through L2/shared memory). bf16 = 2 bytes, fp32 partials of
  the split dW = 4 bytes, index loads ignored.
* A prediction is a lower bound on time for a kernel that reaches the datasheet peaks; real
  kernels reach ~60-80% of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# name fragment in torch.cuda.get_device_name -> (bytes/s, dense bf16 FLOP/s, SM count)
DEVICES = {
    "A100": (2.0e12, 312e12, 108),
    "H100": (3.35e12, 989e12, 132),
}
BF16 = 2


@dataclass(frozen=True)
class GpuPoint:
    """One GPU benchmark point: Y = X·Wᵀ with X (tokens, in_f) and W (out_f, in_f)."""

    phase: str  # "prefill" | "decode"
    tokens: int
    in_f: int
    out_f: int
    op: str  # "fwd" | "fwd+bwd"
    kind: str  # "block" | "2:4"
    block: int  # 0 for 2:4
    sparsity: float

    @property
    def dense_flops(self) -> float:
        """2·M·N·K per GEMM; forward+backward runs 3 GEMMs (Y, dX, dW)."""
        return 2.0 * self.tokens * self.in_f * self.out_f * (3 if self.op == "fwd+bwd" else 1)


@dataclass(frozen=True)
class GpuResult:
    """Median times (ms) of a point and its dense anchor, and the parity check."""

    point: GpuPoint
    density: float
    dense_ms: float
    sparse_ms: float
    check: float

    @property
    def speedup(self) -> float:
        """Dense time / sparse time."""
        return self.dense_ms / self.sparse_ms

    @property
    def dense_tflops(self) -> float:
        """Dense FLOPs per second of cuBLAS (the anchor)."""
        return self.point.dense_flops / self.dense_ms / 1e9

    @property
    def useful_tflops(self) -> float:
        """Non-zero FLOPs (density x dense FLOPs) per second of the sparse kernel."""
        return self.density * self.point.dense_flops / self.sparse_ms / 1e9

    @property
    def efficiency(self) -> float:
        """Useful TFLOP/s of the sparse kernel / dense TFLOP/s of cuBLAS = density x speedup."""
        return self.useful_tflops / self.dense_tflops


def peaks(device_name: str) -> tuple[float, float, int] | None:
    """(bandwidth B/s, dense bf16 FLOP/s, SMs) for an A100 or H100 name, else None."""
    return next((v for k, v in DEVICES.items() if k in device_name), None)


def dense_cost(pt: GpuPoint) -> tuple[float, float]:
    """(FLOPs, bytes) of the cuBLAS anchor: each GEMM reads its operands and writes once."""
    m, n, k = pt.tokens, pt.out_f, pt.in_f
    gemm = (m * k + n * k + m * n) * BF16
    return pt.dense_flops, gemm * (3 if pt.op == "fwd+bwd" else 1)


def block_cost(pt: GpuPoint, nnzb: int, sms: int) -> tuple[float, float]:
    """(FLOPs, bytes) of the Triton block-sparse kernels at this point's configuration."""
    # imported here: bench_sparse sets TRITON_INTERPRET (dry run) before sparse_kernels loads
    from sparse_kernels._bsr_launch import kernel_config, sdd_splits

    m, b, n, k = pt.tokens, pt.block, pt.out_f, pt.in_f
    flops = 2.0 * m * nnzb * b * b
    tiles = b * b * nnzb
    cfg = kernel_config("dsd", b, torch.bfloat16)
    m_tiles = -(-m // cfg["BLOCK_M"])
    # forward: per stored tile, its x columns for all tokens and the tile once per token tile
    fwd = (m * b * nnzb + m_tiles * tiles + m * n) * BF16
    if pt.op == "fwd":
        return flops, fwd
    cfg_t = kernel_config("dsdt", b, torch.bfloat16)
    dx = (m * b * nnzb + -(-m // cfg_t["BLOCK_M"]) * tiles + m * k) * BF16
    splits = sdd_splits(nnzb, m, kernel_config("sdd", b, torch.bfloat16)["BLOCK_M"], 2 * sms)
    partials = 2 * splits * tiles * 4 if splits > 1 else 0  # fp32 write + read by the sum
    dw = 2 * m * b * nnzb * BF16 + partials + tiles * BF16
    return 3 * flops, fwd + dx + dw


def semi24_cost(pt: GpuPoint) -> tuple[float, float]:
    """(FLOPs, bytes) of a 2:4 forward: half the weight's values plus 2 bits of metadata each."""
    m, n, k = pt.tokens, pt.out_f, pt.in_f
    return 2.0 * m * n * k, (m * k + m * n) * BF16 + n * k // 2 * BF16 + n * k // 8


def predict_ms(flops: float, nbytes: float, bandwidth: float, rate: float) -> float:
    """Roofline time in ms: the slower of compute at `rate` and traffic at `bandwidth`."""
    return 1e3 * max(flops / rate, nbytes / bandwidth)


def predictions(pt: GpuPoint, nnzb: int, device_name: str) -> tuple[float, float, str] | None:
    """(dense ms, sparse ms, bound of the sparse side) predicted on `device_name`, or None."""
    peak = peaks(device_name)
    if peak is None:
        return None
    bw, rate, sms = peak
    dense = predict_ms(*dense_cost(pt), bw, rate)
    if pt.kind == "2:4":
        flops, nbytes = semi24_cost(pt)
        sparse_rate = 2 * rate  # the sparse tensor cores' datasheet rate
    else:
        flops, nbytes = block_cost(pt, nnzb, sms)
        sparse_rate = rate
    bound = "compute" if flops / sparse_rate >= nbytes / bw else "memory"
    return dense, predict_ms(flops, nbytes, bw, sparse_rate), bound
