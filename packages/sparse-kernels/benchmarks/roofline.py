"""GPU benchmark points of bench_sparse.py and their predicted times (a model, not a measurement).

For each point the FLOPs and the bytes every kernel moves are counted from its launch
configuration (`sparse_kernels._bsr_launch.kernel_config` / `sdd_splits`, the same functions the
launchers use) and priced by `leanlm_testing.roofline.kernel_seconds`: per kernel the slowest of
tensor-core time, HBM time and L2 time, plus a pipeline fill/drain per wave of programs and a
launch gap; a step is the sum of its kernels, or the host time to issue them if that is longer.
`tests/test_roofline.py` checks the predictions against two H100 tables: the sm_80 kernels at
ca2fc10 (`shared/research/gpu-h100.md` section 3) and both kernel sets at 112dea4.

Counts (bf16 = 2 bytes, fp32 partials = 4, index loads ignored):

* L2 bytes: every load and store as the kernels issue them. The forward (DSD) loads, per stored
  tile, its X columns for every token and the tile once per BLOCK_M-token tile; dX (DSDᵀ) the
  same with dY; dW (SDD) loads dY and X columns of its tile for every token.
* HBM bytes: each operand and output once, plus the re-reads of an operand too large to stay in
  L2 (`fits_l2`: X for the forward, dY for dX). A stored tile is re-read by the programs of all
  token tiles of its row at about the same time (token tiles vary fastest in the grid), and dW's
  programs walk the tokens in step, so those re-reads stay in L2.
* dW with token splits writes fp32 partials that are read back (HBM): by a torch sum after
  the sm_80 kernel, by the sm_90 kernel's last item of each tile pair.
* The sm_90 kernels (`_bsr_hopper`, `_bsr_hopper_dw`) run one program per SM (196 KB of shared
  memory at block 128) over work items, round after round. Without warp specialization or a
  TMA store, an item's output tile (256 x b for forward/dX, two b x b tiles for dW, fp32 when
  split) is stored after its main loop while the tensor cores wait, and every program reaches
  that store at about the same time: the output bytes are added at HBM bandwidth
  (`KernelCost.serial_bytes`) instead of overlapping. A round spans sms / token-tiles output
  blocks that read the same operand rows together, so an operand too large for L2 is read
  from HBM once per round, not once per block.
* The dense anchor (cuBLAS) reads each operand and writes once per GEMM, at the GEMM efficiency.
* Host (`HostCosts`): per call plus per Triton launch. `HOST_A_PRIORI` prices a launch and a
  torch op at `HOST_TRITON_LAUNCH_S` / `HOST_TORCH_OP_S` (op counts: `TORCH_OPS`, estimates);
  `HOST_H100_112DEA4` (the default) is calibrated on the floor of the 112dea4 run's times, where
  an sm_90 launch cost about 85 us more than an sm_80 one (host or launch: not separated).

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


@dataclass(frozen=True, kw_only=True)
class HostCosts:
    """Fixed time of one `BlockSparseLinear` call outside its kernels, as do_bench times it.

    Host work and launch costs (a do_bench time includes them where they exceed the kernels'):
    per call besides the Triton launches (autograd, torch ops), and per launch of each set.
    """

    fwd_s: float
    fwd_bwd_s: float
    sm80_launch_s: float
    sm90_launch_s: float

    def seconds(self, op: str, kernels: str, launches: int) -> float:
        """Host seconds of a call of `op` with `launches` Triton launches of `kernels`."""
        call = self.fwd_s if op == "fwd" else self.fwd_bwd_s
        return call + launches * (self.sm90_launch_s if kernels == "sm90" else self.sm80_launch_s)

    def describe(self) -> str:
        """One line stating the costs (print it with every prediction made with them)."""
        us = {k: 1e6 * v for k, v in vars(self).items()}
        return (
            f"host per call {us['fwd_s']:.0f} us fwd / {us['fwd_bwd_s']:.0f} us fwd+bwd plus "
            f"{us['sm80_launch_s']:.0f} us per sm80 and {us['sm90_launch_s']:.0f} us per sm90 "
            "launch"
        )


#: A priori (`leanlm_testing.roofline`): 15 us per Triton launch, 6 us per torch op
#: (`TORCH_OPS`). It held on the H100 of the ca2fc10 table (4096^2, 10% tiles: 0.054 ms fwd).
HOST_A_PRIORI = HostCosts(
    fwd_s=TORCH_OPS["sparse", "fwd"] * R.HOST_TORCH_OP_S,
    fwd_bwd_s=TORCH_OPS["sparse", "fwd+bwd"] * R.HOST_TORCH_OP_S,
    sm80_launch_s=R.HOST_TRITON_LAUNCH_S, sm90_launch_s=R.HOST_TRITON_LAUNCH_S,
)  # fmt: skip
#: Calibrated, not derived, on the H100 run at 112dea4 (`tests/data/h100_112dea4.json`): the
#: floor that rows whose kernels take far less reached (10% tiles at 4096 tokens, most decode
#: rows): about 0.09 ms per forward and 0.6 ms per forward + backward with the sm_80 kernels,
#: 0.17 / 0.85 ms with the sm_90 ones: about 85 us more per sm_90 launch (0.08 ms per forward,
#: 0.25 per forward + backward). Not located: the host time of a decode call was not higher
#: with sm_90 (0.120 vs 0.139 ms); what an sm_90 launch does that an sm_80 one does not is take
#: two TMA descriptors built on the host (`TensorDescriptor.from_tensor`, encoded by the
#: launcher at every call). The floor depends on the host: at f823ada sm_80 decode calls took
#: 0.011-0.056 ms.
HOST_H100_112DEA4 = HostCosts(fwd_s=75e-6, fwd_bwd_s=555e-6, sm80_launch_s=15e-6,
                              sm90_launch_s=100e-6)  # fmt: skip


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

    serial_bytes: float = 0.0
    """Bytes a persistent program stores after each main loop, not overlapped with loads or dots
    (the sm_90 kernels: one program per SM, no warp specialization, a plain masked store):
    priced at HBM bandwidth on top of the busiest resource."""

    def seconds(self, gpu: R.Gpu) -> float:
        """Predicted device time on `gpu` (`leanlm_testing.roofline.kernel_seconds`)."""
        w = R.waves(gpu, programs=self.programs, shared_bytes=self.shared_bytes,
                    threads=self.threads)  # fmt: skip
        serial = self.serial_bytes / (gpu.hbm_bytes_per_s * R.EFFICIENCY)
        return serial + R.kernel_seconds(
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
    hbm = float(operand + nnzb * b * b * BF16 + out)
    if not R.fits_l2(gpu, operand):
        # sm_80: each program streams its slices from HBM. sm_90: a round of items (one per SM,
        # the token tiles of a block consecutive) spans sms / m_tiles blocks, which read the
        # same operand rows at about the same time: one HBM read serves them all
        share = max(1.0, gpu.sms / m_tiles) if pt.kernels == "sm90" else 1.0
        hbm += max(0.0, reads / share - operand)
    shared = cfg["num_stages"] * (cfg["BLOCK_M"] + b) * cfg["BK"] * BF16
    return KernelCost(
        name, 2.0 * m * nnzb * b * b, hbm, reads + tiles + out,
        programs=m_tiles * -(-out_f // b), shared_bytes=shared, threads=32 * cfg["num_warps"],
        serial_bytes=out if pt.kernels == "sm90" else 0.0,
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
    summed = out + tiles * BF16 if splits > 1 else 0.0  # partials read back, dvalues written
    # sm_90: the last item of each pair sums its partials in the kernel; sm_80: a torch sum
    # and cast after it
    in_kernel = summed if pt.kernels == "sm90" else 0.0
    reads = (m * b * nnzb + m * b * items) * BF16  # X per tile, dY per item
    kernels.append(
        KernelCost(
            "dW",
            2.0 * m * nnzb * b * b,
            (m * n + m * k) * BF16 + out + in_kernel,
            reads + out + in_kernel,
            programs=items * splits,
            threads=32 * cfg["num_warps"],
            shared_bytes=cfg["num_stages"] * (1 + x_boxes) * cfg["BLOCK_M"] * b * BF16,
            serial_bytes=out + in_kernel if pt.kernels == "sm90" else 0.0,
        )
    )
    if summed and not in_kernel:  # the launcher's fp32 sum of the partials, cast to bf16
        kernels.append(KernelCost("dW split sum", 0.0, summed, summed))
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


def predict_ms(
    pt: GpuPoint, nnzb: int, gpu: R.Gpu, *, host: HostCosts = HOST_H100_112DEA4
) -> tuple[float, float, str]:
    """(dense ms, sparse ms, what bounds the sparse side) predicted on `gpu`.

    The sparse side: the sum of its kernels' device times, or `host`'s time of the call if
    longer (the host then sets the pace).
    """
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
    device = sum(kc.seconds(gpu) for kc in kernels)
    sparse = max(device, host.seconds(pt.op, pt.kernels, launches))
    slowest = max(kernels, key=lambda kc: kc.seconds(gpu))
    bound = slowest.bound(gpu) if device >= sparse else "host"
    return dense, 1e3 * sparse, bound


def predictions(
    pt: GpuPoint, nnzb: int, device_name: str, *, host: HostCosts = HOST_H100_112DEA4
) -> tuple[float, float, str] | None:
    """(dense ms, sparse ms, bound of the sparse side) predicted on `device_name`, or None."""
    gpu = gpu_for(device_name)
    return None if gpu is None else predict_ms(pt, nnzb, gpu, host=host)


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
    print(f"# {R.kernel_assumptions()}; {HOST_H100_112DEA4.describe()}")
    print(prediction_table(ISSUE_24, R.H100))
