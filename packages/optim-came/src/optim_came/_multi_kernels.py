# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""Multi-tensor fused CAME step: seven Triton launches per group of matrices of a batch.

Reuses optim-adafactor's batch, work split and address tables (`optim_adafactor._multi_tables`)
and its statistics kernels; adds `_mt_momentum_kernel` and `_mt_came_apply_kernel`. Launching
per group rather than per tensor keeps a model's step to a handful of launches. The launch
order is in `step_batch`; small unfactored tensors take one more launch (`_multi_vec_kernels`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from optim_adafactor import multi_tensor as mt
from optim_adafactor.quant import quant_tile
from optim_came._multi_vec_kernels import step_vectors

if TYPE_CHECKING:
    from optim_adafactor.base import FactoredOptimizer
    from optim_came._torch_path import Work

HAS_TRITON = mt.HAS_TRITON
BLOCK_T = 4 if mt.INTERPRET else 32  # column tiles of a row partial summed per load
NADDR = 6  # parameter, exp_avg, row, col, instability row, instability col
ROW, RES_ROW, RES_COL = 2, 4, 5
launch_config = mt.launch_config

if HAS_TRITON:
    import triton
    import triton.language as tl

    from optim_adafactor.multi_tensor import (
        apply_scalars,
        row_item,
        span,
        sr_counters,
        store_update,
        tile,
    )
    from optim_adafactor.quant import dequant, load_momentum, quant_args, store_momentum

    _GEO = tl.constexpr(mt.GEO)

    @triton.jit  # type: ignore[untyped-decorator]
    def _mt_momentum_kernel(  # type: ignore[no-untyped-def]
        addr, geo, gaddr, items, cfbuf, scal, colpart, rowpart, rpart, g0, m0, beta1, beta3,
        eps2, ALIGNED: tl.constexpr, SUB: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_T: tl.constexpr, STAGES: tl.constexpr, seed_base=0, NADDR: tl.constexpr = 6,
        QUANT: tl.constexpr = False, QSR: tl.constexpr = False,
    ):  # fmt: skip
        """`d = m - g·rs_i·cf_j`, `m ← m - (1-β1)·d`; instability row EMA and column partials.

        One row item per program, column tile by column tile (m is read and written once):
        the column partials of d² accumulate elementwise in [SUB, BLOCK_M] registers over the
        row loop and are reduced over rows once per column tile, after it (a reduction per
        row block crosses warps through shared memory), and written once per item; each row
        block's sum over a tile goes to `rowpart` (one float per row and tile), and after the
        sweep the row EMA `R = β3 R + (1-β3)(β1² mean_j d² + ε2)` (in place) sums them in tile
        order. `rs_i = clip / √(r_i / mean(r))` (scal[mat] = (mean(r), clip)); the column
        EMA scales the partials by β1². m is stored in its own dtype. QUANT: m is int8 codes
        with per-block scales (address 6 of the matrix), decoded and re-encoded in the same
        pass (QSR: stochastically, seeded as the PyTorch path); BLOCK_M is a multiple of 128.
        """
        pid = tl.program_id(0)
        mat = tl.load(items + pid * 5)
        r0 = tl.load(items + pid * 5 + 1)
        r1 = tl.load(items + pid * 5 + 2)
        poff = tl.load(items + pid * 5 + 3)
        roff = tl.load(items + pid * 5 + 4)
        m = tl.load(geo + mat * _GEO + 1)
        cf_off = tl.load(geo + mat * _GEO + 2)
        g_ptr = tl.load(gaddr + mat).to(g0.dtype)
        m_ptr = tl.load(addr + mat * NADDR + 1).to(m0.dtype)
        row_ptr = tl.load(addr + mat * NADDR + 2).to(tl.pointer_type(tl.float32))
        res_ptr = tl.load(addr + mat * NADDR + 4).to(tl.pointer_type(tl.float32))
        q_ptr, qseed = quant_args(addr, geo, mat, seed_base, NADDR, QUANT, QSR)
        n_blocks = tl.cdiv(m, 128)
        if ALIGNED:
            m = tl.multiple_of(m, 16)
            g_ptr = tl.multiple_of(g_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
        tiles = tl.cdiv(m, BLOCK_M)
        mean_r = tl.load(scal + mat * 4)
        clip = tl.load(scal + mat * 4 + 1)
        for c0 in range(0, m, BLOCK_M):
            cols, col_mask = span(c0, m, BLOCK_M)
            cf = tl.load(cfbuf + cf_off + cols, mask=col_mask, other=0.0)
            cacc = tl.zeros([SUB, BLOCK_M], dtype=tl.float32)  # reduced once, after the loop
            for s in tl.range(r0, r1, SUB, num_stages=STAGES):
                rows, row_mask = span(s, r1, SUB)
                rs = clip / tl.sqrt(tl.load(row_ptr + rows, mask=row_mask, other=1.0) / mean_r)
                mask, offs = tile(rows, row_mask, cols, col_mask, m)
                g = tl.load(g_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
                srow = tl.where(row_mask, rows.to(tl.int64) * n_blocks, -1)
                mom = load_momentum(m_ptr, q_ptr, offs, mask, srow, c0, n_blocks, QUANT, SUB,
                                    BLOCK_M)  # fmt: skip
                d = mom - g.to(tl.float32) * rs[:, None] * cf[None, :]  # upcast first
                mom = mom - (1.0 - beta1) * d
                store_momentum(mom, m_ptr, q_ptr, offs, mask, srow, c0, n_blocks, qseed, QUANT,
                               QSR, SUB, BLOCK_M)  # fmt: skip
                d2 = d * d  # masked lanes: g = m = 0, so d = 0
                cacc += d2
                tl.store(rowpart + roff + (rows - r0) * tiles + c0 // BLOCK_M,
                         tl.sum(d2, axis=1), mask=row_mask)  # fmt: skip
            tl.store(colpart + poff + cols, tl.sum(cacc, axis=0), mask=col_mask)
        tl.debug_barrier()  # the row partials are read back, maybe by other threads
        row_coef = beta1 * beta1 / m.to(tl.float32)
        acc_r = tl.zeros([SUB], dtype=tl.float32)
        for s in range(r0, r1, SUB):
            rows, row_mask = span(s, r1, SUB)
            dacc = tl.zeros([SUB, BLOCK_T], dtype=tl.float32)
            for t0 in range(0, tiles, BLOCK_T):  # tile order: deterministic
                ts = t0 + tl.arange(0, BLOCK_T)
                mask = row_mask[:, None] & (ts < tiles)[None, :]
                offs = roff + (rows - r0)[:, None] * tiles + ts[None, :]
                dacc += tl.load(rowpart + offs, mask=mask, other=0.0)
            dsum = tl.sum(dacc, axis=1)
            res_old = tl.load(res_ptr + rows, mask=row_mask, other=1.0)
            res_new = beta3 * res_old + (1.0 - beta3) * (dsum * row_coef + eps2)
            tl.store(res_ptr + rows, res_new, mask=row_mask)
            acc_r += tl.where(row_mask, res_new, 0.0)
        tl.store(rpart + pid, tl.sum(acc_r, axis=0))

    @triton.jit  # type: ignore[untyped-decorator]
    def _mt_came_apply_kernel(  # type: ignore[no-untyped-def]
        addr, geo, items, cfbuf, scal, p0, m0, seed_base,
        HAS_DECAY: tl.constexpr, SR: tl.constexpr, ALIGNED: tl.constexpr, SUB: tl.constexpr,
        BLOCK_M: tl.constexpr, STAGES: tl.constexpr, NADDR: tl.constexpr = 6,
        QUANT: tl.constexpr = False,
    ):  # fmt: skip
        """`p ← p - wd·lr·p - m · rrs_i · cR_j` in fp32, stored in p's dtype (SR for bf16).

        One row item per program, streamed (`evict_first`). `rrs_i = lr / √(R_i / mean(R))`
        (scal[mat] = (mean(R), lr, wd·lr, lr)); the decay is came-pytorch's
        `p.add_(p, alpha=-wd·lr)`.
        """
        mat, r0, r1, m, cf_off = row_item(items, geo, _GEO)
        p_ptr = tl.load(addr + mat * NADDR + 0).to(p0.dtype)
        m_ptr = tl.load(addr + mat * NADDR + 1).to(m0.dtype)
        res_ptr = tl.load(addr + mat * NADDR + 4).to(tl.pointer_type(tl.float32))
        q_ptr, _ = quant_args(addr, geo, mat, 0, NADDR, QUANT, False)
        n_blocks = tl.cdiv(m, 128)
        if ALIGNED:
            # `m` reloaded: a hint on a helper's return value is lost when the helper is
            # inlined, and without it every load of the tile is scalar (1 element per thread)
            m = tl.multiple_of(tl.load(geo + mat * _GEO + 1), 16)
            p_ptr = tl.multiple_of(p_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
        mean_res, lr, wd_lr, seed = apply_scalars(scal, geo, mat, seed_base, HAS_DECAY, SR)
        for s in range(r0, r1, SUB):
            rows, row_mask = span(s, r1, SUB)
            res = tl.load(res_ptr + rows, mask=row_mask, other=1.0)
            rrs = lr / tl.sqrt(res / mean_res)
            for c0 in tl.range(0, m, BLOCK_M, num_stages=STAGES):
                cols, col_mask = span(c0, m, BLOCK_M)
                mask, offs = tile(rows, row_mask, cols, col_mask, m)
                cr = tl.load(cfbuf + cf_off + cols, mask=col_mask, other=0.0)
                if QUANT:
                    srow = tl.where(row_mask, rows.to(tl.int64) * n_blocks, -1)
                    mom = dequant(m_ptr, q_ptr, offs, mask, srow, c0, n_blocks, SUB, BLOCK_M)
                else:
                    mom = tl.load(m_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
                p = tl.load(p_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
                upd = mom.to(tl.float32) * rrs[:, None] * cr[None, :]
                ctr = sr_counters(rows, c0, m, BLOCK_M)
                store_update(p_ptr, offs, mask, p.to(tl.float32), upd, wd_lr, seed, ctr,
                             HAS_DECAY, SR)  # fmt: skip

    def gpu_launch_configs() -> list[dict[str, Any]]:
        """Every launch `step_batch` makes on a GPU (for tools/gpu_compile.py).

        Gradient/parameter dtypes bf16, fp16, fp32; `exp_avg` fp32, bf16 or int8
        (`state_dtype`; int8 with nearest and stochastic codes, 7 addresses per matrix);
        aligned and unaligned batches; every flag. Also optim-adafactor's statistics, column
        and scalar kernels with CAME's table layouts. The vector step's launches are listed by
        `_multi_vec`.
        """
        i64, f32, i8 = torch.int64, torch.float32, torch.int8
        launches: list[dict[str, Any]] = []
        args: dict[str, Any]
        for dtype in (torch.bfloat16, torch.float16, f32):
            for aligned in (True, False):
                sub, bm, warps = launch_config(aligned, stats=True)
                opts: dict[str, Any] = {"num_warps": warps}
                tile = {"ALIGNED": aligned, "SUB": sub, "BLOCK_M": bm, "STAGES": mt.stages(aligned)}
                for naddr in (NADDR, NADDR + 1):
                    args = {"addr": i64, "geo": i64, "gaddr": i64, "items": i64, "colpart": f32,
                            "wpart": f32, "rpart": f32, "ppart": f32, "g0": dtype, "p0": dtype,
                            "beta2": 0.999, "eps1": 1e-30, "HAS_P": False, "NADDR": naddr,
                            **tile}  # fmt: skip
                    launches.append({"kernel": mt.stats_kernel, "args": args, "options": opts})
                for m_dtype, qsr in (
                    (f32, False),
                    (torch.bfloat16, False),
                    (i8, False),
                    (i8, True),
                ):
                    quant = m_dtype == i8
                    q_sub, q_bm, q_warps = quant_tile(sub, bm, warps, quant=quant)
                    args = {"addr": i64, "geo": i64, "gaddr": i64, "items": i64, "cfbuf": f32,
                            "scal": f32, "colpart": f32, "rowpart": f32, "rpart": f32,
                            "g0": dtype, "m0": m_dtype, "beta1": 0.9, "beta3": 0.9999,
                            "eps2": 1e-16, "BLOCK_T": BLOCK_T, **tile, "SUB": q_sub,
                            "BLOCK_M": q_bm, "seed_base": 12345 if quant else 0,
                            "NADDR": NADDR + quant, "QUANT": quant, "QSR": qsr}  # fmt: skip
                    cap = momentum_maxnreg(dtype, m_dtype, aligned=aligned)
                    opts = {"num_warps": q_warps, "maxnreg": cap}
                    launches.append({"kernel": _mt_momentum_kernel, "args": args, "options": opts})
                for m_dtype in (f32, torch.bfloat16, i8):
                    quant = m_dtype == i8
                    a_sub, a_bm, a_warps = quant_tile(
                        *launch_config(aligned), quant=quant, apply=True
                    )
                    tile = {"ALIGNED": aligned, "SUB": a_sub, "BLOCK_M": a_bm,
                            "STAGES": mt.stages(aligned), "NADDR": NADDR + quant,
                            "QUANT": quant}  # fmt: skip
                    for has_decay in (False, True):
                        for sr in (False, True) if dtype == torch.bfloat16 else (False,):
                            args = {"addr": i64, "geo": i64, "items": i64, "cfbuf": f32,
                                    "scal": f32, "p0": dtype, "m0": m_dtype,
                                    "seed_base": 12345, "HAS_DECAY": has_decay, "SR": sr,
                                    **tile}  # fmt: skip
                            launches.append({"kernel": _mt_came_apply_kernel, "args": args,
                                             "options": {"num_warps": a_warps}})  # fmt: skip
        for naddr in (NADDR, NADDR + 1):
            for col, has_w in ((3, True), (RES_COL, False)):
                for aligned in (True, False):
                    launches.append(mt.cols_launch_config(naddr=naddr, col=col, has_w=has_w,
                                                          aligned=aligned))  # fmt: skip
        return launches


# ---------------------------------------------------------------------------------- launcher
def momentum_maxnreg(g_dtype: torch.dtype, m_dtype: torch.dtype, *, aligned: bool) -> int | None:
    """Register cap (`maxnreg`) of a `_mt_momentum_kernel` launch; None: ptxas's own choice.

    With the column sums in [SUB, BLOCK_M] accumulators, ptxas's own choice spills on sm_90
    (tools/gpu_compile.py, triton 3.7.1's ptxas) with 16-bit g and fp32 m on aligned rows (96
    registers, 24 bytes spilled). A cap of 112 makes ptxas use more registers instead (108
    used; 4 blocks of 128 threads per SM, as the 109 registers before the change). int8 m on
    unaligned rows needed a cap of 216 too until its scales were loaded and divided once per
    block, not per element: uncapped it now takes 165-191 registers and spills nothing. Every
    other configuration keeps ptxas's choice.
    """
    if aligned and m_dtype == torch.float32 and g_dtype != torch.float32:
        return 112
    return None


def fuse_vector(p: Tensor) -> bool:
    """Whether an unfactored parameter takes the batched vector step (optim-adafactor's rule)."""
    return mt.fusable(p)


def eligible(w: Work) -> bool:
    """Whether `w` can join a batch: a plain, non-empty 2-D matrix, or a fused vector."""
    if not w.factored:
        return w.state["exp_avg"].dtype in (torch.float32, torch.bfloat16)
    m_dtypes = (torch.float32, torch.bfloat16, torch.int8)
    return mt.eligible_matrix(w) and w.state["exp_avg"].dtype in m_dtypes  # type: ignore[arg-type]


def batch_key(w: Work) -> tuple[object, ...]:
    """Works with equal keys share one set of launches (options, step, dtypes, alignment)."""
    m = w.state["exp_avg"]
    if not w.factored:
        return ("vec", id(w.opts), w.step, w.param.dtype, w.grad.dtype, m.dtype)
    aligned = mt.aligned([w.param, w.grad, m])
    return (id(w.opts), w.step, w.param.dtype, w.grad.dtype, m.dtype, aligned)


def step_batch(
    opt: FactoredOptimizer, works: list[Work], cache: dict[tuple[object, ...], Any]
) -> None:
    """One fused CAME step of every matrix in `works` (same `batch_key`).

    Seven launches per group of matrices (`_multi_tables`), for a matrix `g` of shape (n, m):

    1. optim-adafactor's `_mt_stats_kernel` (via its `launch_stats`, as are 2 and 3): row EMA `r`
       and the column partials of g² and g²/r;
    2. its `_mt_cols_kernel`: column EMA `c`, `cf` and the partials of Σu²;
    3. its `_mt_scalars_kernel` (lr = 1, clip on): `mean(r)` and the clip `1/max(1, RMS(u)/d)`;
    4. `_mt_momentum_kernel`: `d = m - g·rs_i·cf_j`, `m ← m - (1-β1) d`, and the row EMA `R` of
       the instability `β1² d²`;
    5. `_mt_cols_kernel` again on `d²`: column EMA `C` and `cR = 1/√C`;
    6. `_mt_scalars_kernel` again: `mean(R)`, lr and wd·lr (a tensor lr stays on the device);
    7. `_mt_came_apply_kernel`: `p ← p - wd·lr·p - m · lr·rR_i · cR_j`.

    m is read twice (passes 4 and 7) because the instability factors need all of `m_new` before
    `p` can be written. Unfactored tensors (a batch of them) take
    `_multi_vec_kernels.step_vectors`: one launch.
    """
    w0 = works[0]
    if not w0.factored:
        step_vectors(opt, works, cache)
        return
    o, step, p0, g0, m0 = w0.opts, w0.step, w0.param, w0.grad, w0.state["exp_avg"]
    is_aligned = bool(batch_key(w0)[-1])
    quant = m0.dtype == torch.int8  # codes + scales (address 6): tiles of whole 128-blocks
    sub, bm, warps = quant_tile(*launch_config(is_aligned), quant=quant, apply=True)
    # the momentum kernel's tiles
    m_sub, m_bm, m_warps = quant_tile(*launch_config(is_aligned, stats=True), quant=quant)
    naddr = NADDR + 1 if quant else NADDR
    keys = ["exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_res_col"]
    keys += ["exp_avg_scale"] if quant else []
    mats = [(w.param, *(w.state[k] for k in keys)) for w in works]
    tables = mt.tables_for(cache, mats, works, is_aligned)
    buf = tables.buf
    corr2 = math.sqrt(o.second_moment_correction(step))  # rsqrt(c / (1-β2^t))
    corr3 = math.sqrt(o.instability_correction(step))
    sr = o.stochastic_rounding and p0.dtype == torch.bfloat16
    seed_base = (opt._sr_seed + 1_000_003 * step) % (2**31 - 1)
    gb, mb, pb = mt.size(g0.dtype), mt.size(m0.dtype), mt.size(p0.dtype)
    for group, gaddr in zip(tables.groups, tables.gaddr([w.grad for w in works]), strict=True):
        mt.launch_stats(tables, group, gaddr, g0, p0, beta2=o.beta2, eps1=o.eps1, has_p=False,
                        naddr=naddr, is_aligned=is_aligned)  # fmt: skip
        mt.launch_cols(tables, group, beta2=o.beta2, eps1=o.eps1, col_mult=1.0, cf_scale=corr2,
                       naddr=naddr, col=3, has_w=True, is_aligned=is_aligned)  # fmt: skip
        mt.launch_scalars(tables, group, 1.0, eps2=0.0, clip_threshold=o.clip_threshold,
                          coef=1.0, weight_decay=0.0, has_p=False)  # fmt: skip
        work = group.row_work
        nbytes = work.total * (gb + 2 * mb) + 4 * group.partial_floats + 16 * group.n_rows
        nbytes += 8 * work.total // m_bm  # row partials, written then read
        nbytes += 8 * work.total // 128 if quant else 0  # block scales, read and written
        if not mt.planned(_mt_momentum_kernel, work, nbytes):
            _mt_momentum_kernel[(len(group.rows),)](
                group.addr, group.geo, gaddr, group.rows, buf["cf"], group.scal, buf["colpart"],
                buf["rowpart"], buf["rpart"], g0, m0, o.beta1, o.beta3, o.eps2,
                ALIGNED=is_aligned, SUB=m_sub, BLOCK_M=m_bm, BLOCK_T=BLOCK_T,
                STAGES=mt.stages(is_aligned), seed_base=seed_base, NADDR=naddr, QUANT=quant,
                QSR=quant and o.stochastic_rounding, num_warps=m_warps,
                maxnreg=momentum_maxnreg(g0.dtype, m0.dtype, aligned=is_aligned),
            )  # fmt: skip
        mt.launch_cols(tables, group, beta2=o.beta3, eps1=o.eps2, col_mult=o.beta1 * o.beta1,
                       cf_scale=corr3, naddr=naddr, col=RES_COL, has_w=False,
                       is_aligned=is_aligned)  # fmt: skip
        mt.launch_scalars(tables, group, o.lr, eps2=0.0, clip_threshold=None, coef=1.0,
                          weight_decay=o.weight_decay, has_p=False)  # fmt: skip
        if not mt.planned(_mt_came_apply_kernel, work, work.total * (mb + 2 * pb + quant / 32)):
            _mt_came_apply_kernel[(len(group.rows),)](
                group.addr, group.geo, group.rows, buf["cf"], group.scal, p0, m0, seed_base,
                HAS_DECAY=o.weight_decay != 0, SR=sr, ALIGNED=is_aligned, SUB=sub, BLOCK_M=bm,
                STAGES=mt.stages(is_aligned), NADDR=naddr, QUANT=quant, num_warps=warps,
            )  # fmt: skip
