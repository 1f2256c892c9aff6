# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""Statistics kernels of the multi-tensor fused step, shared by Adafactor and optim-came's CAME.

Launches 1-3 of `_multi_kernels.step_batch`, one launch each for all the matrices of a group:
`_mt_stats_kernel` (row EMA, column partials), `_mt_cols_kernel` (column EMA, `cf`) and
`_mt_scalars_kernel` (per-matrix scalars). No launcher here: each optimizer launches them with
its own table layout (`NADDR` addresses per matrix) and lists those launches in its own
`gpu_launch_configs()`, so this module's list is empty.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from optim_adafactor import _multi_tables as mt

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    import triton
    import triton.language as tl

    from optim_adafactor._jit_helpers import span, tensor_seed, tile

    # addr columns: parameter, exp_avg (or the parameter), row EMA, column EMA
    _P = tl.constexpr(0)
    _MOM = tl.constexpr(1)
    _ROW = tl.constexpr(2)
    _COL = tl.constexpr(3)
    _NADDR = tl.constexpr(4)
    _GEO = tl.constexpr(mt.GEO)

    @triton.jit  # type: ignore[untyped-decorator]
    def _mt_stats_kernel(  # type: ignore[no-untyped-def]
        addr, geo, gaddr, items, colpart, wpart, rpart, ppart, g0, p0, beta2, eps1,
        HAS_P: tl.constexpr, ALIGNED: tl.constexpr, SUB: tl.constexpr, BLOCK_M: tl.constexpr,
        NADDR: tl.constexpr, STAGES: tl.constexpr,
    ):  # fmt: skip
        """Row EMA `r = β2 r + (1-β2)(mean_j g² + ε1)` in place; column partials of g², g²/r.

        One row item (R rows) per program. Sweep 1 walks the item's row blocks and finishes
        their row sums, hence `r`; sweep 2 walks it again column tile by column tile (the item
        was just read: L2) and writes each column's partials once, from registers. `addr`
        rows hold NADDR addresses: parameter, momentum, row EMA, column EMA, ...
        """
        pid = tl.program_id(0)
        mat = tl.load(items + pid * 5)
        r0 = tl.load(items + pid * 5 + 1)
        r1 = tl.load(items + pid * 5 + 2)
        poff = tl.load(items + pid * 5 + 3)
        m = tl.load(geo + mat * _GEO + 1)
        g_ptr = tl.load(gaddr + mat).to(g0.dtype)
        p_ptr = tl.load(addr + mat * NADDR + _P).to(p0.dtype)
        row_ptr = tl.load(addr + mat * NADDR + _ROW).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            m = tl.multiple_of(m, 16)
            g_ptr = tl.multiple_of(g_ptr, 16)
            p_ptr = tl.multiple_of(p_ptr, 16)
        m_f = m.to(tl.float32)
        # Sums accumulate elementwise in [SUB, BLOCK_M] fp32 registers and are reduced once,
        # after their loop: a `tl.sum` per tile is shuffles, and across warps shared-memory
        # stores, loads and barriers on every iteration (the L1-bound profile of issue 23).
        # The order is fixed (each lane sums its tiles in order, then one reduction tree):
        # deterministic, though not the same rounding as summing tile by tile.
        acc_r = tl.zeros([SUB], dtype=tl.float32)
        acc_p = tl.zeros([SUB, BLOCK_M], dtype=tl.float32)
        for s in range(r0, r1, SUB):  # sweep 1: row sums, whole rows (g from DRAM)
            rows, row_mask = span(s, r1, SUB)
            racc = tl.zeros([SUB, BLOCK_M], dtype=tl.float32)
            for c0 in tl.range(0, m, BLOCK_M, num_stages=STAGES):
                cols, col_mask = span(c0, m, BLOCK_M)
                mask, offs = tile(rows, row_mask, cols, col_mask, m)
                g = tl.load(g_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_last")
                g = g.to(tl.float32)  # upcast first
                racc += g * g
                if HAS_P:
                    p = tl.load(p_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
                    p = p.to(tl.float32)
                    acc_p += p * p
            rsum = tl.sum(racc, axis=1)
            r_old = tl.load(row_ptr + rows, mask=row_mask, other=1.0)
            r_new = beta2 * r_old + (1.0 - beta2) * (rsum / m_f + eps1)
            tl.store(row_ptr + rows, r_new, mask=row_mask)
            acc_r += tl.where(row_mask, r_new, 0.0)
        tl.debug_barrier()  # sweep 2 reads r back, maybe from other threads
        for c0 in range(0, m, BLOCK_M):  # sweep 2: column partials, written once per item
            cols, col_mask = span(c0, m, BLOCK_M)
            cacc = tl.zeros([SUB, BLOCK_M], dtype=tl.float32)
            wacc = tl.zeros([SUB, BLOCK_M], dtype=tl.float32)
            for s in tl.range(r0, r1, SUB, num_stages=STAGES):
                rows, row_mask = span(s, r1, SUB)
                inv_r = 1.0 / tl.load(row_ptr + rows, mask=row_mask, other=1.0)
                mask, offs = tile(rows, row_mask, cols, col_mask, m)
                g = tl.load(g_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
                g2 = g.to(tl.float32) * g.to(tl.float32)
                cacc += g2
                wacc += g2 * inv_r[:, None]
            tl.store(colpart + poff + cols, tl.sum(cacc, axis=0), mask=col_mask)
            tl.store(wpart + poff + cols, tl.sum(wacc, axis=0), mask=col_mask)
        tl.store(rpart + pid, tl.sum(acc_r, axis=0))
        if HAS_P:
            tl.store(ppart + pid, tl.sum(tl.sum(acc_p, axis=1), axis=0))

    @triton.jit  # type: ignore[untyped-decorator]
    def _mt_cols_kernel(  # type: ignore[no-untyped-def]
        addr, geo, items, colpart, wpart, cfbuf, upart, beta2, eps1, col_mult, cf_scale,
        BLOCK_C: tl.constexpr, BLOCK_I: tl.constexpr, NADDR: tl.constexpr, COL: tl.constexpr,
        HAS_W: tl.constexpr, ALIGNED: tl.constexpr,
    ):  # fmt: skip
        """Column EMA `c = β c + (1-β)(col_mult · mean_i x + ε)` in place, `cf = cf_scale/√c`.

        One column item (a range of columns of one matrix) per program; the partials of the
        matrix's row items are summed in a fixed order, BLOCK_I items at a time. `x` is g²
        (Adafactor, CAME's first statistic; `col_mult` = 1) or CAME's `d²` (`col_mult` = β1²);
        `COL` is the column of `addr` holding the EMA. With `HAS_W`, also the partial
        `Σ_j W_j cf_j²` of Σu² (W: the column sums of g²/r). `ALIGNED`: every matrix's column
        count is a multiple of 16, hence so are the partial offsets, the column items' bounds
        (multiples of BLOCK_C, or m) and the `cf` offsets: the partials load as 16-byte vectors.
        """
        pid = tl.program_id(0)
        mat = tl.load(items + pid * 3)
        c_lo = tl.load(items + pid * 3 + 1)
        c_hi = tl.load(items + pid * 3 + 2)
        n = tl.load(geo + mat * _GEO + 0)
        m = tl.load(geo + mat * _GEO + 1)
        cf_off = tl.load(geo + mat * _GEO + 2)
        n_items = tl.load(geo + mat * _GEO + 4)
        part = tl.load(geo + mat * _GEO + 7)
        col_ptr = tl.load(addr + mat * NADDR + COL).to(tl.pointer_type(tl.float32))
        if ALIGNED:  # hints on the values used for addressing, in the kernel body
            m = tl.multiple_of(m, 16)
            part = tl.multiple_of(part, 16)
            c_lo = tl.multiple_of(c_lo, 16)
            c_hi = tl.multiple_of(c_hi, 16)
            cf_off = tl.multiple_of(cf_off, 16)
        usum = tl.zeros([BLOCK_C], dtype=tl.float32)
        for c0 in range(c_lo, c_hi, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            col_mask = cols < c_hi
            cacc = tl.zeros([BLOCK_I, BLOCK_C], dtype=tl.float32)
            wacc = tl.zeros([BLOCK_I, BLOCK_C], dtype=tl.float32)
            for k in tl.range(0, n_items, BLOCK_I, num_stages=2):  # fixed order
                ks = k + tl.arange(0, BLOCK_I)
                mask = (ks < n_items)[:, None] & col_mask[None, :]
                offs = part + ks[:, None].to(tl.int64) * m + cols[None, :]
                cacc += tl.load(colpart + offs, mask=mask, other=0.0)
                if HAS_W:
                    wacc += tl.load(wpart + offs, mask=mask, other=0.0)
            csum = tl.sum(cacc, axis=0)
            c_old = tl.load(col_ptr + cols, mask=col_mask, other=1.0)
            c_new = beta2 * c_old + (1.0 - beta2) * (csum * col_mult / n.to(tl.float32) + eps1)
            tl.store(col_ptr + cols, c_new, mask=col_mask)
            cf = cf_scale / tl.sqrt(c_new)
            tl.store(cfbuf + cf_off + cols, cf, mask=col_mask)
            if HAS_W:
                usum += tl.where(col_mask, tl.sum(wacc, axis=0) * cf * cf, 0.0)
        if HAS_W:
            tl.store(upart + pid, tl.sum(usum, axis=0))

    @triton.jit  # type: ignore[untyped-decorator]
    def apply_scalars(  # type: ignore[no-untyped-def]
        scal, geo, mat, seed_base, HAS_DECAY: tl.constexpr, SR: tl.constexpr
    ):
        """A matrix's `(scal[0], scal[1], wd·lr or 0, rounding seed or 0)` for an apply kernel."""
        wd_lr = 0.0
        if HAS_DECAY:
            wd_lr = tl.load(scal + mat * 4 + 2)
        seed = 0
        if SR:
            seed = tensor_seed(seed_base, tl.load(geo + mat * _GEO + 8))
        return tl.load(scal + mat * 4), tl.load(scal + mat * 4 + 1), wd_lr, seed

    @triton.jit  # type: ignore[untyped-decorator]
    def _segment_sum(ptr, start, count, BLOCK_K: tl.constexpr):  # type: ignore[no-untyped-def]
        """Σ ptr[start : start + count] in fp32, in a fixed order."""
        acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k in range(0, count, BLOCK_K):
            idx = k + tl.arange(0, BLOCK_K)
            acc += tl.load(ptr + start + idx, mask=idx < count, other=0.0)
        return tl.sum(acc, axis=0)

    @triton.jit  # type: ignore[untyped-decorator]
    def _mt_scalars_kernel(  # type: ignore[no-untyped-def]
        geo, rpart, ppart, upart, scal, lr_ptr, lr, eps2, clip_threshold, coef, weight_decay,
        LR_TENSOR: tl.constexpr, HAS_P: tl.constexpr, CLIP: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Per matrix: `scal = (mean(r), lr_t·clip·coef, wd·lr_t, lr_t)`.

        `lr_t = lr · max(ε2, RMS(p))` with parameter scaling, `clip = 1/max(1, RMS(u)/d)` and
        `coef` = (1-β1 with momentum) · (-1 when maximizing).
        """
        mat = tl.program_id(0)
        n = tl.load(geo + mat * _GEO + 0)
        m = tl.load(geo + mat * _GEO + 1)
        a0 = tl.load(geo + mat * _GEO + 3)
        na = tl.load(geo + mat * _GEO + 4)
        b0 = tl.load(geo + mat * _GEO + 5)
        nb = tl.load(geo + mat * _GEO + 6)
        numel = (n * m).to(tl.float32)
        mean_r = _segment_sum(rpart, a0, na, BLOCK_K) / n.to(tl.float32)
        lr_t = tl.load(lr_ptr).to(tl.float32) if LR_TENSOR else lr
        if HAS_P:
            psq = _segment_sum(ppart, a0, na, BLOCK_K)
            lr_t = lr_t * tl.maximum(tl.sqrt(psq / numel), eps2)
        scale = lr_t
        if CLIP:
            usq = mean_r * _segment_sum(upart, b0, nb, BLOCK_K)
            scale = scale / tl.maximum(tl.sqrt(usq / numel) / clip_threshold, 1.0)
        tl.store(scal + mat * 4, mean_r)
        tl.store(scal + mat * 4 + 1, scale * coef)
        tl.store(scal + mat * 4 + 2, lr_t * weight_decay)
        tl.store(scal + mat * 4 + 3, lr_t)

    def gpu_launch_configs() -> list[dict[str, Any]]:
        """No launches of its own (for tools/gpu_compile.py); see the module docstring.

        The kernels are compiled through `_multi_kernels.gpu_launch_configs()` and optim-came's,
        which list every launch their `step_batch` makes of them.
        """
        return []
