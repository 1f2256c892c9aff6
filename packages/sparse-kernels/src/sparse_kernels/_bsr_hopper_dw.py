# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""Hopper (sm_90) dW kernel: dvalues[p] = dY[:, r_p]ᵀ · X[:, c_p] with TMA, wgmma, persistent.

The sampled product (SDD) of `_bsr_kernels._sdd_kernel` for sm_90: dY and X slices arrive as TMA
boxes, the token loop is multi-buffered into wgmma dots, and a work item is a pair of consecutive
tiles of one block row (`_bsr_plan.pair_starts`, built once per layout) and a token split, so one
dY box feeds both tiles. Splits as `sdd_triton`; chosen with `_bsr_hopper` by `use_sm90`; design
notes in benchmarks/RESULTS.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sparse_kernels._bsr_hopper import SM90_BLOCK_SIZES
from sparse_kernels._bsr_kernels import _check_sdd_args
from sparse_kernels._bsr_launch import aligned, dot_precision, sdd_plan, sm_count
from sparse_kernels._bsr_plan import sm90_plan
from sparse_kernels._triton import HAS_TRITON, INTERPRET
from sparse_kernels.layout import BlockLayout


def sm90_dw_config(block_size: int, dtype: torch.dtype) -> dict[str, int]:
    """Launch configuration of the Hopper dW kernel: `BLOCK_M` tokens per loop step.

    Shared memory per stage: 3 · BLOCK_M · b · bytes (a dY box and two X boxes); 4 stages.
    """
    if block_size not in SM90_BLOCK_SIZES:
        raise ValueError(f"`block_size` ({block_size}) must be in {SM90_BLOCK_SIZES} for sm_90")
    wide = dtype == torch.float32
    return {"BLOCK_M": 32 if wide else 64, "num_warps": 8 if block_size == 128 else 4,
            "num_stages": 4}  # fmt: skip


if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit  # type: ignore[untyped-decorator]
    def _sum_splits(ws_ptr, out_ptr, t, mask, plane, splits, BS: tl.constexpr):  # type: ignore[no-untyped-def]
        """out[t] = Σ_k ws[k · plane + t], k = 0, 1, ..., splits - 1 in that order (fp32).

        Stored in out's dtype. One tile at a time (one fp32 accumulator live: registers). The
        loads are .cg: from L2, where the other programs' partials are, never a stale L1 line.
        """
        acc = tl.zeros([BS, BS], dtype=tl.float32)
        for k in range(0, splits):
            acc += tl.load(ws_ptr + k * plane + t, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + t, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit  # type: ignore[untyped-decorator]
    def _sdd_tma_kernel(  # type: ignore[no-untyped-def]
        dy_desc,
        x_desc,
        pair_start,
        row_idx,
        col_idx,
        out_ptr,
        ws_ptr,
        count_ptr,
        M,
        nnzb,
        n_pairs,
        m_per_split,
        n_programs,
        SPLIT: tl.constexpr,
        UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
        BS: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """Items w = pid, pid + n_programs, ...: tiles p0, p1 of pair w mod n_pairs, split s.

        out[s, p] = Σ_{m in split s} dY[m, r]ᵀ X[m, c_p] for the (one or) two tiles p of a pair,
        which share their block row r: one dY box per token step feeds both dots. A pair with
        one tile (the last of an odd row) loads its X box twice and stores once. Split s covers
        tokens [s·m_per_split, (s+1)·m_per_split) (a multiple of BLOCK_M); fp32 accumulators,
        one cast on store.

        With SPLIT (more than one split), each item stores its fp32 partials to ws_ptr[s] and
        counts itself in count_ptr[pair] (one atomic, released after a CTA barrier, so the
        partials are visible before the count); the item that counts last sums the pair's
        partials of splits 0, 1, ... in that order (a fixed order, whichever item is last:
        deterministic), stores the sum once in out's dtype and resets the count to 0 for the
        next launch. No sum or cast launch after the kernel.
        """
        pid = tl.program_id(0)
        splits = tl.cdiv(M, m_per_split)
        offs_b = tl.arange(0, BS)
        tile = offs_b[:, None] * BS + offs_b[None, :]
        for w in range(pid, n_pairs * splits, n_programs):
            g = w % n_pairs
            s = w // n_pairs
            p0 = tl.load(pair_start + g)
            p1 = tl.load(pair_start + g + 1) - 1  # == p0 for a single tile
            r = tl.load(row_idx + p0)
            c0 = tl.load(col_idx + p0)
            c1 = tl.load(col_idx + p1)
            m_lo = s * m_per_split
            m_hi = tl.minimum(m_lo + m_per_split, M)
            acc0 = tl.zeros([BS, BS], dtype=tl.float32)
            acc1 = tl.zeros([BS, BS], dtype=tl.float32)
            for m0 in range(m_lo, m_hi, BLOCK_M):
                dy = dy_desc.load([m0, r * BS])
                x0 = x_desc.load([m0, c0 * BS])
                x1 = x_desc.load([m0, c1 * BS])
                if UPCAST:
                    dy = dy.to(tl.float32)
                    x0 = x0.to(tl.float32)
                    x1 = x1.to(tl.float32)
                dyt = tl.trans(dy)
                acc0 = tl.dot(dyt, x0, acc0, input_precision=PRECISION)
                acc1 = tl.dot(dyt, x1, acc1, input_precision=PRECISION)
            t0 = p0.to(tl.int64) * (BS * BS) + tile
            t1 = p1.to(tl.int64) * (BS * BS) + tile
            two = (tile >= 0) & (p1 > p0)
            if SPLIT:
                plane = nnzb.to(tl.int64) * (BS * BS)  # one split's partials
                tl.store(ws_ptr + s * plane + t0, acc0)
                tl.store(ws_ptr + s * plane + t1, acc1, mask=two)
                tl.debug_barrier()  # every thread's partials issued before the release
                done = tl.atomic_add(count_ptr + g, 1, sem="acq_rel", scope="gpu")
                if done == splits - 1:  # the last item of this pair: sum in split order
                    _sum_splits(ws_ptr, out_ptr, t0, tile >= 0, plane, splits, BS)
                    _sum_splits(ws_ptr, out_ptr, t1, two, plane, splits, BS)
                    tl.atomic_xchg(count_ptr + g, 0)  # ready for the next launch
            else:
                tl.store(out_ptr + t0, acc0.to(out_ptr.dtype.element_ty))
                tl.store(out_ptr + t1, acc1.to(out_ptr.dtype.element_ty), mask=two)

    def sdd_sm90(
        dy: Tensor,
        x: Tensor,
        layout: BlockLayout,
        values: Tensor,
        *,
        config: dict[str, int] | None = None,
        splits: int | None = None,
        programs: int | None = None,
    ) -> Tensor:
        """dvalues[p] = dY[:, r_p]ᵀ·X[:, c_p] with the Hopper kernel; (nnzb, b, b) in x's dtype.

        `splits` as `_bsr_kernels.sdd_triton` (default `sdd_splits`), `programs` the persistent
        grid (default one per SM, 4 on CPU).
        """
        _check_sdd_args(dy, x, layout, values, splits)
        M, nnzb, b = x.shape[0], layout.nnzb, layout.block_size
        if nnzb == 0 or M == 0:
            return torch.zeros_like(values)
        cfg = config or sm90_dw_config(b, x.dtype)
        bm = cfg["BLOCK_M"]
        dy, x = aligned(dy), aligned(x)
        dy, x = (t if t.data_ptr() % 16 == 0 else t.clone() for t in (dy, x))
        plan = sm90_plan(layout)  # built once per layout: no device -> host copy here
        starts, n_pairs = plan.pair_starts, plan.n_pairs
        splits, per = sdd_plan(M, n_pairs, bm, splits, x.device)  # splits for the pairs
        out = torch.empty_like(values)
        # fp32 partials of every split; the kernel sums them (its last item per pair)
        ws = values.new_empty(splits, *values.shape, dtype=torch.float32) if splits > 1 else out
        programs = max(1, min(programs or sm_count(x.device), n_pairs * splits))
        _sdd_tma_kernel[(programs,)](
            TensorDescriptor.from_tensor(dy, [bm, b]), TensorDescriptor.from_tensor(x, [bm, b]),
            starts, layout.row_idx, layout.col_idx, out, ws, plan.pair_counts, M, nnzb, n_pairs,
            per, n_programs=programs, SPLIT=splits > 1, UPCAST=INTERPRET,
            PRECISION=dot_precision(x.dtype), BS=b, BLOCK_M=bm, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )  # fmt: skip
        return out

    def gpu_launch_configs() -> list[dict[str, Any]]:
        """The Hopper dW kernel's launches for tools/gpu_compile.py (sm_90; TMA, wgmma required).

        Blocks 64/128, bf16/fp16 and fp32 as TF32, one split (dvalues written directly) and
        several (fp32 partials summed in the kernel), tokens a multiple of 16 and not.
        """
        launches: list[dict[str, Any]] = []
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for bs in SM90_BLOCK_SIZES:
                cfg = sm90_dw_config(bs, dtype)
                for M in (4096, 4095):
                    for split in (False, True):
                        t = torch.empty(M, 4096, dtype=dtype, device="meta")
                        desc = TensorDescriptor.from_tensor(t, [cfg["BLOCK_M"], bs])
                        args = {"dy_desc": desc, "x_desc": desc, "pair_start": torch.int32,
                                "row_idx": torch.int32, "col_idx": torch.int32, "out_ptr": dtype,
                                "ws_ptr": torch.float32 if split else dtype,
                                "count_ptr": torch.int32, "M": M, "nnzb": 409, "n_pairs": 205,
                                "m_per_split": 512, "n_programs": 132, "SPLIT": split,
                                "UPCAST": False, "PRECISION": "tf32", "BS": bs,
                                "BLOCK_M": cfg["BLOCK_M"]}  # fmt: skip
                        options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
                        launches.append({"kernel": _sdd_tma_kernel, "args": args,
                                         "options": options, "archs": ("sm_90",),
                                         "requires": ("tma", "wgmma")})  # fmt: skip
        return launches
