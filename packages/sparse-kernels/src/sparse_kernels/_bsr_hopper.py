# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""Hopper (sm_90) block-sparse kernel for the forward and dX: TMA, wgmma, persistent grid.

The products of `_bsr_kernels` that multiply a dense A by stored tiles of W:
Y[:, r] = Σ_{p in row r} X[:, c_p] · values[p]ᵀ (+ bias) and dX[:, c] = Σ_{p in col c}
dY[:, r_p] · values[p]. Unlike the sm_80 kernels, A and W boxes arrive by TMA (zero-filled past
the edges), dots are wgmma, the token tile is 256 rows (W re-read 4x less often) and one
program per SM walks (output block, token tile) items longest block first (`schedule`).
`use_sm90` picks it (and dW's `_bsr_hopper_dw`) where `prefer_sm90`'s measured crossover says
it is faster; design notes in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from sparse_kernels._bsr_kernels import _check
from sparse_kernels._bsr_launch import aligned, capability, cdiv, dot_precision, sm_count
from sparse_kernels._bsr_plan import sm90_plan
from sparse_kernels._triton import HAS_TRITON, INTERPRET
from sparse_kernels.layout import BlockLayout

SM90_BLOCK_SIZES = (64, 128)
"""Tile edges the Hopper kernel takes (16/32 stay on the sm_80 kernels)."""
ENV = "SPARSE_KERNELS_SM90"
SM90_MIN_TOKENS = 256
"""Fewest tokens for which "auto" picks the Hopper kernels: one full token tile (`BLOCK_M`).

Fewer tokens fill part of the one 256-row tile (the rest is zero-filled work) and give the
persistent grid one item per output block. Not fitted: the kernel's tile (the measured rows
below 256 tokens fall under `SM90_MIN_WORK` anyway)."""
SM90_MIN_WORK = 45e9
"""Fewest multiply-adds of one product, tokens x stored weight elements (nnzb · b²), for which
"auto" picks the Hopper kernels (`prefer_sm90`).

Fitted to the H100 run at 112dea4 (benchmarks/RESULTS.md, `tests/data/h100_112dea4.json`):
with 4096 tokens the sm_90 path won at 4096->14336 with 50% and 25% of the tiles (60-120 G
multiply-adds; fwd+bwd at block 128, 25% excepted) and lost at 4096->4096 and at 10% tiles
(<= 34.4 G; the forward at block 64, 50% excepted), and it lost every decode row (1-256 tokens,
<= 7.5 G) but one. 45 G is the geometric middle of the gap. What sets it is a fixed cost: an
sm_90 call took about 0.085 ms more per launch outside the kernels (inferred from the times'
floor; where it goes is not known: not in torch ops, allocations or host reads, which
benchmarks/bench_ops.py counts), which only a long enough product hides."""


def prefer_sm90(tokens: int, stored: int) -> bool:
    """Whether the Hopper kernels beat the sm_80 ones (the crossover measured on an H100).

    For a product of `tokens` rows with a block-sparse weight of `stored` elements in stored
    tiles (nnzb · b²): at least `SM90_MIN_TOKENS` tokens and `SM90_MIN_WORK` multiply-adds.
    The same for the forward, dX and dW of one call (they do the same multiply-adds), so a
    call runs all three on one kernel set. Pure arithmetic: no device needed.
    """
    return tokens >= SM90_MIN_TOKENS and tokens * stored >= SM90_MIN_WORK


def sm90_config(block_size: int, dtype: torch.dtype) -> dict[str, int]:
    """Launch configuration of the Hopper kernel for b x b tiles of `dtype`.

    `BLOCK_M` tokens x b features per work item, `BK` the reduction chunk per loop step (one
    TMA box of A and one of W), 8 warps (two warpgroups, 128 tokens each), 4 stages (3 for
    fp32, whose boxes are twice the bytes). Shared memory per stage: (BLOCK_M + b) · BK · bytes.
    """
    if block_size not in SM90_BLOCK_SIZES:
        raise ValueError(f"`block_size` ({block_size}) must be in {SM90_BLOCK_SIZES} for sm_90")
    wide = dtype == torch.float32
    return {"BLOCK_M": 256, "BK": 32 if wide else 64, "num_warps": 8,
            "num_stages": 3 if wide else 4}  # fmt: skip


def use_sm90(
    device: torch.device, block_size: int, dtype: torch.dtype, tokens: int, stored: int
) -> bool:
    """Whether the Triton path runs the Hopper kernels (forward, dX and dW) for this call.

    `SPARSE_KERNELS_SM90` unset or "auto": on an sm_90 CUDA device, for block sizes in
    `SM90_BLOCK_SIZES` where `prefer_sm90(tokens, stored)` (`stored`: nnzb · b²), unless fp32
    is asked to be IEEE (no tensor cores: the sm_80 kernels). "1": always (an unsupported
    block size raises); "0": never.
    """
    mode = os.environ.get(ENV, "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"`{ENV}` ({mode!r}) must be 'auto', '0' or '1'")
    if mode == "0" or not HAS_TRITON:
        return False
    if mode == "1":
        if block_size not in SM90_BLOCK_SIZES:
            raise ValueError(
                f"{ENV}=1 needs `block_size` in {SM90_BLOCK_SIZES}, got {block_size}; "
                f"unset {ENV} to use the sm_80 kernels"
            )
        return True
    return (
        capability(device) == (9, 0)  # queried once per device
        and block_size in SM90_BLOCK_SIZES
        and prefer_sm90(tokens, stored)
        and dot_precision(dtype) != "ieee"
    )


def schedule(segments: list[int], token_tiles: int, programs: int) -> list[list[tuple[int, int]]]:
    """Work items (output block, token tile) of each program, in the order the kernel runs them.

    `segments[i]` is the number of stored tiles of output block i; blocks run longest-first
    (stable), the token tiles of one block consecutively; program `pid` takes items pid,
    pid + programs, ...
    """
    order = sorted(range(len(segments)), key=lambda i: -segments[i])
    items = [(blk, t) for blk in order for t in range(token_tiles)]
    return [items[pid::programs] for pid in range(programs)]


if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit  # type: ignore[untyped-decorator]
    def _bsr_tma_kernel(  # type: ignore[no-untyped-def]
        a_desc,
        w_desc,
        seg_ptr,
        perm,
        idx,
        order,
        b_ptr,
        out_ptr,
        trace_ptr,
        M,
        n_out,
        n_blocks,
        stride_om,
        n_programs,
        TRANS_W: tl.constexpr,
        HAS_PERM: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        TRACE: tl.constexpr,
        UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
        BS: tl.constexpr,
        BK: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """Persistent program: work items w = pid, pid + n_programs, ... of (block, token tile).

        Block j = order[w // tiles_m] (output block row for the forward, block column for dX),
        token tile w % tiles_m. Its stored tiles are positions q in [seg_ptr[j], seg_ptr[j+1]):
        tile p = perm[q] (q itself without HAS_PERM), reduction block idx[p]. Per (tile, chunk
        of BK): A box (BLOCK_M, BK) at (tokens, idx[p]·BS + kk) and W box at rows p·BS (+ kk for
        dX), then acc += A · W-boxᵀ (forward, box (BS, BK)) or A · W-box (dX, box (BK, BS)).
        The tile index of the next step is loaded one step ahead (loop-carried), so the TMA
        coordinates never wait on a load of the same step and the loop pipelines. With TRACE,
        program pid writes the blocks and token tiles it ran, in order, to trace_ptr (tests).
        """
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        offs_b = tl.arange(0, BS)
        steps = BS // BK
        n_items = n_blocks * tiles_m
        for w in range(pid, n_items, n_programs):
            j = tl.load(order + w // tiles_m)
            m0 = (w % tiles_m) * BLOCK_M
            start = tl.load(seg_ptr + j)
            end = tl.load(seg_ptr + j + 1)
            p = tl.load(perm + start, mask=start < end, other=0) if HAS_PERM else start
            c = tl.load(idx + p, mask=start < end, other=0)
            acc = tl.zeros([BLOCK_M, BS], dtype=tl.float32)
            for it in range(0, (end - start) * steps):
                kk = (it % steps) * BK
                a = a_desc.load([m0, c * BS + kk])
                wt = w_desc.load([p * BS + kk, 0]) if TRANS_W else w_desc.load([p * BS, kk])
                q_next = start + (it + 1) // steps
                p = tl.load(perm + q_next, mask=q_next < end, other=0) if HAS_PERM else q_next
                c = tl.load(idx + p, mask=q_next < end, other=0)
                if UPCAST:
                    a = a.to(tl.float32)
                    wt = wt.to(tl.float32)
                if TRANS_W:
                    acc = tl.dot(a, wt, acc, input_precision=PRECISION)
                else:
                    acc = tl.dot(a, tl.trans(wt), acc, input_precision=PRECISION)
            offs_m = m0 + tl.arange(0, BLOCK_M)
            n = j * BS + offs_b
            if HAS_BIAS:
                acc += tl.load(b_ptr + n, mask=n < n_out, other=0.0).to(tl.float32)[None, :]
            tl.store(
                out_ptr + offs_m[:, None].to(tl.int64) * stride_om + n[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=(offs_m[:, None] < M) & (n[None, :] < n_out),
            )
            if TRACE:
                tl.store(trace_ptr + 2 * w, j)  # w = round · n_programs + pid
                tl.store(trace_ptr + 2 * w + 1, w % tiles_m)

    def _weight_desc(
        values: Tensor, box: tuple[int, int], cache: dict[tuple[int, int], Any]
    ) -> TensorDescriptor:
        """TMA descriptor of the stored tiles as (nnzb · b, b) rows, read in `box` boxes.

        Kept in `cache` (one entry per box shape, `Sm90Plan.weight_descs`) and reused while
        `values` is the same memory (address, dtype, shape, strides, device): an optimizer
        updates the tiles in place, which the descriptor (an address, not a copy) sees. A
        non-contiguous `values` is copied and not cached. The entry holds a view of the weight
        it was built for until a call with other memory replaces it.
        """
        key = (values.data_ptr(), values.dtype, values.shape, values.stride(), values.device)
        hit = cache.get(box)
        if hit is not None and hit[0] == key:
            return hit[1]
        b = values.shape[-1]
        if not values.is_contiguous():
            return TensorDescriptor.from_tensor(values.contiguous().view(-1, b), list(box))
        desc = TensorDescriptor.from_tensor(values.view(-1, b), list(box))
        cache[box] = (key, desc)
        return desc

    def _launch(
        a: Tensor,
        values: Tensor,
        out: Tensor,
        segments: tuple[Tensor, Tensor | None, Tensor, Tensor],
        bias: Tensor | None,
        *,
        trans_w: bool,
        config: dict[str, int] | None,
        programs: int | None,
        trace: Tensor | None,
        weights: dict[tuple[int, int], Any],
    ) -> None:
        seg_ptr, perm, idx, order = segments  # order: the plan's longest-first blocks
        if a.shape[0] == 0:
            return
        if values.shape[0] == 0:  # no stored tile (TMA boxes need a non-empty tensor)
            out.copy_(bias.expand_as(out) if bias is not None else torch.zeros_like(out))
            return
        b = values.shape[-1]
        cfg = config or sm90_config(b, a.dtype)
        bm, bk = cfg["BLOCK_M"], cfg["BK"]
        a = aligned(a)
        if a.data_ptr() % 16:  # TMA needs a 16-byte aligned base
            a = a.clone()
        a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
        w_desc = _weight_desc(values, (bk, b) if trans_w else (b, bk), weights)
        n_blocks = seg_ptr.numel() - 1
        M = a.shape[0]
        items = n_blocks * cdiv(M, bm)
        programs = max(1, min(programs or sm_count(a.device), items))
        _bsr_tma_kernel[(programs,)](
            a_desc, w_desc, seg_ptr, perm if perm is not None else seg_ptr, idx, order,
            bias if bias is not None else out, out, trace if trace is not None else seg_ptr,
            M, out.shape[1], n_blocks, out.stride(0),
            n_programs=programs, TRANS_W=trans_w, HAS_PERM=perm is not None,
            HAS_BIAS=bias is not None, TRACE=trace is not None, UPCAST=INTERPRET,
            PRECISION=dot_precision(a.dtype), BS=b, BK=bk, BLOCK_M=bm,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip

    def dsd_sm90(
        x: Tensor,
        values: Tensor,
        layout: BlockLayout,
        bias: Tensor | None,
        *,
        config: dict[str, int] | None = None,
        programs: int | None = None,
        trace: Tensor | None = None,
    ) -> Tensor:
        """Y = X·Wᵀ (+ bias) with the Hopper kernel; x (M, K) -> (M, N).

        `config` overrides `sm90_config`, `programs` the persistent grid (default: one per SM,
        4 on CPU); `trace` (int32, 2 · items) gets (block, token tile) of item w at 2w, 2w + 1.
        """
        _check(x, values, layout, layout.in_features, "x")
        y = torch.empty(x.shape[0], layout.out_features, device=x.device, dtype=x.dtype)
        plan = sm90_plan(layout)
        segments = (layout.row_ptr, None, layout.col_idx, plan.row_order)
        _launch(x, values, y, segments, bias, trans_w=False, config=config, programs=programs,
                trace=trace, weights=plan.weight_descs)  # fmt: skip
        return y

    def dsdt_sm90(
        dy: Tensor,
        values: Tensor,
        layout: BlockLayout,
        *,
        config: dict[str, int] | None = None,
        programs: int | None = None,
        trace: Tensor | None = None,
    ) -> Tensor:
        """DX = dY·W with the Hopper kernel; dy (M, N) -> (M, K). Arguments as `dsd_sm90`."""
        _check(dy, values, layout, layout.out_features, "dy")
        dx = torch.empty(dy.shape[0], layout.in_features, device=dy.device, dtype=dy.dtype)
        plan = sm90_plan(layout)
        segments = (layout.col_ptr, layout.t_perm, layout.row_idx, plan.col_order)
        _launch(dy, values, dx, segments, None, trans_w=True, config=config, programs=programs,
                trace=trace, weights=plan.weight_descs)  # fmt: skip
        return dx

    def gpu_launch_configs() -> list[dict[str, Any]]:
        """The Hopper kernel's launches for tools/gpu_compile.py (sm_90 only; TMA, wgmma required).

        Forward (with bias) and dX for block sizes 64 and 128, bf16/fp16 and fp32 as TF32 (the
        dtypes `use_sm90` selects it for), tokens a multiple of 16 and not; descriptors over
        meta tensors (only dtype and box shape enter the compile).
        """
        launches: list[dict[str, Any]] = []
        i32 = torch.int32
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for bs in SM90_BLOCK_SIZES:
                cfg = sm90_config(bs, dtype)
                bm, bk = cfg["BLOCK_M"], cfg["BK"]
                for M in (4096, 4095):
                    for trans_w in (False, True):
                        a = torch.empty(M, 4096, dtype=dtype, device="meta")
                        w2 = torch.empty(400 * bs, bs, dtype=dtype, device="meta")
                        args = {
                            "a_desc": TensorDescriptor.from_tensor(a, [bm, bk]),
                            "w_desc": TensorDescriptor.from_tensor(
                                w2, [bk, bs] if trans_w else [bs, bk]
                            ),
                            "seg_ptr": i32, "perm": i32, "idx": i32, "order": i32,
                            "b_ptr": dtype, "out_ptr": dtype, "trace_ptr": i32,
                            "M": M, "n_out": 4096, "n_blocks": 4096 // bs, "stride_om": 4096,
                            "n_programs": 132, "TRANS_W": trans_w, "HAS_PERM": trans_w,
                            "HAS_BIAS": not trans_w, "TRACE": False, "UPCAST": False,
                            "PRECISION": "tf32", "BS": bs, "BK": bk, "BLOCK_M": bm,
                        }  # fmt: skip
                        options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
                        launches.append({"kernel": _bsr_tma_kernel, "args": args,
                                         "options": options, "archs": ("sm_90",),
                                         "requires": ("tma", "wgmma")})  # fmt: skip
        return launches
