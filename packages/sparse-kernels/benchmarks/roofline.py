"""GPU benchmark points of bench_sparse.py and their predicted times (a model, not a measurement).

For each point the FLOPs and the bytes every kernel moves are counted from its launch
configuration (`sparse_kernels._bsr_launch.kernel_config` / `sdd_splits`, the same functions the
launchers use) and priced by `leanlm_testing.roofline.kernel_seconds`: per kernel the slowest of
tensor-core time, HBM time and L2 time, plus a pipeline fill/drain per wave of programs and a
launch gap; a step is the sum of its kernels, or the host time to issue them if that is longer.
`tests/test_roofline.py` checks the predictions against the H100 times of
`shared/research/gpu-h100.md` section 3.

Counts (bf16 = 2 bytes, fp32 partials = 4, index loads ignored):

* L2 bytes: every load and store as the kernels issue them. The forward (DSD) loads, per stored
  tile, its X columns for every token and the tile once per BLOCK_M-token tile; dX (DSDᵀ) the
  same with dY; dW (SDD) loads dY and X columns of its tile for every token.
* HBM bytes: each operand and output once, plus the re-reads of an operand too large to stay in
  L2 (`fits_l2`: X for the forward, dY for dX). A stored tile is re-read by the programs of all
  token tiles of its row at about the same time (token tiles vary fastest in the grid), and dW's
  programs walk the tokens in step, so those re-reads stay in L2.
* dW with token splits writes fp32 partials that a torch sum reads back (HBM).
* The dense anchor (cuBLAS) reads each operand and writes once per GEMM, at the GEMM efficiency.
* Host: a Triton launch or a torch op costs the host `HOST_TRITON_LAUNCH_S` / `HOST_TORCH_OP_S`;
  the counts of torch ops per call are estimates (`TORCH_OPS`).

Hardware constants (`leanlm_testing.roofline.kernel_assumptions()`): A100/H100 datasheet peaks,
the H100 L2 bandwidth (calibrated once on that table), a GEMM efficiency and a per-wave latency.
2:4 rows: torch's kernels at twice the dense rate (the sparse tensor cores' datasheet rate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanlm_testing import roofline as R

BF16 = 2
FP32 = 4
#: torch ops per call besides the Triton launches (host estimate): forward: reshape, padding
#: check, contiguous, empty, reshape; forward + backward adds ones_like, dy.contiguous, the
#: backward's empties, the split sum, gradient accumulation and the autograd bookkeeping.
TORCH_OPS = {("sparse", "fwd"): 5, ("sparse", "fwd+bwd"): 14, ("dense", "fwd"): 1,
             ("dense", "fwd+bwd"): 6}  # fmt: skip


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
    kernels: str = "sm80"
    """Forward/dX kernels: "sm80" (`_bsr_kernels`, every GPU) or "sm90" (`_bsr_hopper`)."""

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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def gpu_for(device_name: str) -> R.Gpu | None:
    """The model's A100 or H100 for a CUDA device name, else None."""
    return next((g for g in R.GPUS if g.name.split("-")[0] in device_name), None)


@dataclass(frozen=True)
class KernelCost:
    """What one kernel launch does: FLOPs, bytes through HBM and L2, its grid and footprint."""

    name: str
    flops: float
    hbm_bytes: float
    l2_bytes: float
    programs: int = 1
    shared_bytes: int = 0
    threads: int = 128

    def seconds(self, gpu: R.Gpu) -> float:
        """Predicted device time on `gpu` (`leanlm_testing.roofline.kernel_seconds`)."""
        w = R.waves(gpu, programs=self.programs, shared_bytes=self.shared_bytes,
                    threads=self.threads)  # fmt: skip
        return R.kernel_seconds(
            gpu, flops=self.flops, hbm_bytes=self.hbm_bytes, l2_bytes=self.l2_bytes, waves=w
        )

    def bound(self, gpu: R.Gpu) -> str:
        """Which resource sets the time: "compute", "HBM" or "L2"."""
        times = R.resource_seconds(
            gpu, flops=self.flops, hbm_bytes=self.hbm_bytes, l2_bytes=self.l2_bytes
        )
        return max(times, key=lambda k: times[k])


def _gemm_tile_cost(
    name: str, pt: GpuPoint, nnzb: int, gpu: R.Gpu, *, out_f: int, in_f: int
) -> KernelCost:
    """DSD (forward: out_f = pt.out_f) or DSDᵀ (dX: the same with in/out swapped).

    The sm_90 kernel is persistent (one program per SM walking work items); each work item
    (token tile, output block) fills and drains its pipeline as a program of the sm_80 kernels
    does, so it is counted as one program: waves = items / (SMs x resident items per SM).
    """
    from sparse_kernels._bsr_hopper import sm90_config
    from sparse_kernels._bsr_launch import kernel_config

    m, b = pt.tokens, pt.block
    if pt.kernels == "sm90":
        cfg = sm90_config(b, torch.bfloat16)
    else:
        cfg = kernel_config("dsd" if name == "forward" else "dsdt", b, torch.bfloat16)
    m_tiles = -(-m // cfg["BLOCK_M"])
    operand = m * in_f * BF16  # X (forward) or dY (dX): its slices are re-read per stored tile
    reads = m * b * nnzb * BF16
    tiles = m_tiles * nnzb * b * b * BF16
    out = m * out_f * BF16
    hbm = operand + nnzb * b * b * BF16 + out
    if not R.fits_l2(gpu, operand):
        hbm += reads - operand
    shared = cfg["num_stages"] * (cfg["BLOCK_M"] + b) * cfg["BK"] * BF16
    return KernelCost(
        name, 2.0 * m * nnzb * b * b, hbm, reads + tiles + out,
        programs=m_tiles * -(-out_f // b), shared_bytes=shared, threads=32 * cfg["num_warps"],
    )  # fmt: skip


def block_kernels(pt: GpuPoint, nnzb: int, gpu: R.Gpu) -> list[KernelCost]:
    """The kernel launches of one call of the Triton `BlockSparseLinear` at this point."""
    # imported here: bench_sparse sets TRITON_INTERPRET (dry run) before sparse_kernels loads
    from sparse_kernels._bsr_launch import kernel_config, sdd_splits

    m, b, n, k = pt.tokens, pt.block, pt.out_f, pt.in_f
    kernels = [_gemm_tile_cost("forward", pt, nnzb, gpu, out_f=n, in_f=k)]
    if pt.op == "fwd":
        return kernels
    kernels.append(_gemm_tile_cost("dX", pt, nnzb, gpu, out_f=k, in_f=n))
    # sm_90: a program owns a pair of tiles of one block row (about nnzb / 2 pairs: exact when
    # every row has an even count) and loads each dY box once for both
    items, x_boxes = (_cdiv(nnzb, 2), 2) if pt.kernels == "sm90" else (nnzb, 1)
    if pt.kernels == "sm90":
        from sparse_kernels._bsr_hopper_dw import sm90_dw_config

        cfg = sm90_dw_config(b, torch.bfloat16)
    else:
        cfg = kernel_config("sdd", b, torch.bfloat16)
    splits = sdd_splits(items, m, cfg["BLOCK_M"], 2 * gpu.sms)
    per = _cdiv(_cdiv(m, splits), cfg["BLOCK_M"]) * cfg["BLOCK_M"]
    splits = _cdiv(m, per)  # as the launcher rounds them
    tiles = nnzb * b * b
    out = splits * tiles * FP32 if splits > 1 else tiles * BF16
    reads = (m * b * nnzb + m * b * items) * BF16  # X per tile, dY per item
    kernels.append(
        KernelCost(
            "dW",
            2.0 * m * nnzb * b * b,
            (m * n + m * k) * BF16 + out,
            reads + out,
            programs=items * splits,
            threads=32 * cfg["num_warps"],
            shared_bytes=cfg["num_stages"] * (1 + x_boxes) * cfg["BLOCK_M"] * b * BF16,
        )
    )
    if splits > 1:  # the launcher's fp32 sum of the partials, cast to bf16
        kernels.append(KernelCost("dW split sum", 0.0, out + tiles * BF16, out + tiles * BF16))
    return kernels


def dense_kernels(pt: GpuPoint) -> list[KernelCost]:
    """The dense anchor's GEMMs (cuBLAS): each reads its operands and writes once."""
    m, n, k = pt.tokens, pt.out_f, pt.in_f
    gemm = (m * k + n * k + m * n) * BF16
    count = 3 if pt.op == "fwd+bwd" else 1
    return [KernelCost("cuBLAS", 2.0 * m * n * k, gemm, gemm) for _ in range(count)]


def step_seconds(kernels: list[KernelCost], gpu: R.Gpu, *, launches: int, torch_ops: int) -> float:
    """Sum of the kernels' device times, or the host time to issue the call if longer."""
    device = sum(kc.seconds(gpu) for kc in kernels)
    host = launches * R.HOST_TRITON_LAUNCH_S + torch_ops * R.HOST_TORCH_OP_S
    return max(device, host)


def predict_ms(pt: GpuPoint, nnzb: int, gpu: R.Gpu) -> tuple[float, float, str]:
    """(dense ms, sparse ms, what bounds the sparse side) predicted on `gpu`."""
    dense = 1e3 * step_seconds(
        dense_kernels(pt), gpu, launches=0, torch_ops=TORCH_OPS["dense", pt.op]
    )
    if pt.kind == "2:4":
        m, n, k = pt.tokens, pt.out_f, pt.in_f
        nbytes = (m * k + m * n) * BF16 + n * k // 2 * BF16 + n * k // 8
        # the sparse tensor cores' datasheet rate is twice the dense one: half the FLOPs
        kc = KernelCost("2:4", m * n * k, nbytes, nbytes)
        return dense, 1e3 * step_seconds([kc], gpu, launches=0, torch_ops=3), kc.bound(gpu)
    kernels = block_kernels(pt, nnzb, gpu)
    launches = sum(kc.name != "dW split sum" for kc in kernels)
    sparse = step_seconds(kernels, gpu, launches=launches, torch_ops=TORCH_OPS["sparse", pt.op])
    device = sum(kc.seconds(gpu) for kc in kernels)
    slowest = max(kernels, key=lambda kc: kc.seconds(gpu))
    bound = slowest.bound(gpu) if device >= sparse else "host"
    return dense, 1e3 * sparse, bound


def predictions(pt: GpuPoint, nnzb: int, device_name: str) -> tuple[float, float, str] | None:
    """(dense ms, sparse ms, bound of the sparse side) predicted on `device_name`, or None."""
    gpu = gpu_for(device_name)
    return None if gpu is None else predict_ms(pt, nnzb, gpu)


#: The issue-24 points: bf16, 4096 and 8192 tokens, three weights, 50% and 25% tile density.
ISSUE_24 = [
    GpuPoint("prefill", tokens, in_f, out_f, op, "block", block, sparsity, kernels)
    for in_f, out_f in ((4096, 4096), (4096, 14336), (5120, 20480))
    for tokens in (4096, 8192)
    for op in ("fwd", "fwd+bwd")
    for block in (128, 64)
    for sparsity in (0.5, 0.75)
    for kernels in ("sm80", "sm90")
]


def prediction_table(points: list[GpuPoint], gpu: R.Gpu) -> str:
    """Markdown rows of predicted dense and sparse ms at `points` on `gpu` (model output)."""
    lines = [
        "| in->out | tokens | op | block | density | kernels | dense ms | sparse ms | speedup "
        "| bound |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for pt in points:
        tiles = _cdiv(pt.out_f, pt.block) * _cdiv(pt.in_f, pt.block)
        nnzb = tiles - round(pt.sparsity * tiles)
        dense, sparse, bound = predict_ms(pt, nnzb, gpu)
        lines.append(
            f"| {pt.in_f}->{pt.out_f} | {pt.tokens} | {pt.op} | {pt.block} | "
            f"{1 - pt.sparsity:.0%} | {pt.kernels} | {dense:.3f} | {sparse:.3f} | "
            f"{dense / sparse:.2f}x | {bound} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    # python packages/sparse-kernels/benchmarks/roofline.py: the issue-24 predictions on an H100
    print(f"# {R.kernel_assumptions()}")
    print(prediction_table(ISSUE_24, R.H100))
