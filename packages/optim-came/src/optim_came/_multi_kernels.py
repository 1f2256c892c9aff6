# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""Multi-tensor fused CAME step: seven Triton launches for all the matrices of a batch.

The batch and its tables are optim-adafactor's (`optim_adafactor._multi_tables`; `addr` rows
hold the parameter, `exp_avg`, the row and column EMAs of g², and the row and column EMAs of
the instability). For a matrix `g` of shape (n, m):

1. optim-adafactor's `_mt_stats_kernel` (in `optim_adafactor._multi_stats_kernels`, as are those
   of 2 and 3): row EMA `r` and the column partials of g² and g²/r;
2. its `_mt_cols_kernel`: column EMA `c`, `cf` and partials of Σu² (the mat-vec fold);
3. its `_mt_scalars_kernel` (lr = 1, clip on): `mean(r)` and the clip `1/max(1, RMS(u)/d)`;
4. `_mt_momentum_kernel`, one program per chunk of rows: `d = m - g·rs_i·cf_j` (`rs` = clip
   · rf), `m ← m - (1-β1) d`, the row EMA `R` of the instability `β1² d²` (in place) and its
   column partials (the instability is `(û - m_new)² = β1² d²`, see `_torch_path.momentum`);
5. `_mt_cols_kernel` again on `d²`: column EMA `C` and `cR = 1/√C`;
6. `_mt_scalars_kernel` again: `mean(R)`, lr and wd·lr (a tensor lr stays on the device);
7. `_mt_came_apply_kernel`, one program per 8 or 16 rows: `p ← p - wd·lr·p - m · lr·rR_i · cR_j`.

Small unfactored tensors take one more launch for all of them (`_multi_vec`).

DRAM bytes per element (computed from the kernels): G (pass 1; its second sweep re-reads the
row block from L2), G + 2M (pass 4), M + 2P (pass 7), and the O(n + m) partials: 2G + 3M + 2P =
20 B with bf16 g/p and fp32 m (`bytes_per_element`). The second read of m is forced by the
instability factors, which need all of `m_new` before the parameter can be written.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from optim_adafactor import _multi_kernels as af
from optim_adafactor import _multi_stats_kernels as st
from optim_adafactor import _multi_tables as mt
from optim_adafactor import _multi_vec_kernels as vec
from optim_came._multi_vec_kernels import step_vectors

if TYPE_CHECKING:
    from optim_came._torch_path import Work
    from optim_came.optimizer import CAME

HAS_TRITON = af.HAS_TRITON
BLOCK_C, BLOCK_K = af.BLOCK_C, af.BLOCK_K
NADDR = 6  # parameter, exp_avg, row, col, instability row, instability col
ROW, RES_ROW, RES_COL = 2, 4, 5
launch_config = af.launch_config

if HAS_TRITON:
    import triton
    import triton.language as tl

    from optim_adafactor.factored import store_update, tensor_seed

    _GEO = tl.constexpr(mt.GEO)

    @triton.jit  # type: ignore[untyped-decorator]
    def _mt_momentum_kernel(  # type: ignore[no-untyped-def]
        addr, geo, gaddr, items, cfbuf, scal, colpart, rpart, g0, m0, beta1, beta3, eps2,
        ALIGNED: tl.constexpr, SUB: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """`d = m - g·rs_i·cf_j`, `m ← m - (1-β1)·d`; instability row EMA and column partials.

        `rs_i = clip / √(r_i / mean(r))` (scal[mat] = (mean(r), clip)). The row EMA is
        `R = β3 R + (1-β3)(β1² mean_j d² + ε2)`, in place; the column partials of d² go to
        `colpart` (the column EMA scales them by β1²). m is stored in its own dtype.
        """
        pid = tl.program_id(0)
        mat = tl.load(items + pid * 4)
        r0 = tl.load(items + pid * 4 + 1)
        r1 = tl.load(items + pid * 4 + 2)
        poff = tl.load(items + pid * 4 + 3)
        m = tl.load(geo + mat * _GEO + 1)
        cf_off = tl.load(geo + mat * _GEO + 2)
        g_ptr = tl.load(gaddr + mat).to(g0.dtype)
        m_ptr = tl.load(addr + mat * 6 + 1).to(m0.dtype)
        row_ptr = tl.load(addr + mat * 6 + 2).to(tl.pointer_type(tl.float32))
        res_ptr = tl.load(addr + mat * 6 + 4).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            m = tl.multiple_of(m, 16)
            g_ptr = tl.multiple_of(g_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
        row_coef = beta1 * beta1 / m.to(tl.float32)
        mean_r = tl.load(scal + mat * 4)
        clip = tl.load(scal + mat * 4 + 1)
        acc_r = tl.zeros([SUB], dtype=tl.float32)
        for s in range(r0, r1, SUB):
            rows = s + tl.arange(0, SUB)
            row_mask = rows < r1
            r = tl.load(row_ptr + rows, mask=row_mask, other=1.0)
            rs = clip / tl.sqrt(r / mean_r)
            dsum = tl.zeros([SUB], dtype=tl.float32)
            not_first = s > r0
            for c0 in range(0, m, BLOCK_M):
                cols = c0 + tl.arange(0, BLOCK_M)
                col_mask = cols < m
                mask = row_mask[:, None] & col_mask[None, :]
                offs = rows[:, None].to(tl.int64) * m + cols[None, :]
                g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # upcast first
                mom = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                cf = tl.load(cfbuf + cf_off + cols, mask=col_mask, other=0.0)
                d = mom - g * rs[:, None] * cf[None, :]
                mom = mom - (1.0 - beta1) * d
                tl.store(m_ptr + offs, mom.to(m_ptr.dtype.element_ty), mask=mask)
                d2 = d * d  # masked lanes: g = m = 0, so d = 0
                dsum += tl.sum(d2, axis=1)
                cpart = tl.sum(d2, axis=0)
                cpart += tl.load(colpart + poff + cols, mask=col_mask & not_first, other=0.0)
                tl.store(colpart + poff + cols, cpart, mask=col_mask)
            res_old = tl.load(res_ptr + rows, mask=row_mask, other=1.0)
            res_new = beta3 * res_old + (1.0 - beta3) * (dsum * row_coef + eps2)
            tl.store(res_ptr + rows, res_new, mask=row_mask)
            acc_r += tl.where(row_mask, res_new, 0.0)
            tl.debug_barrier()  # the next sub-block reads the partials back
        tl.store(rpart + pid, tl.sum(acc_r, axis=0))

    @triton.jit  # type: ignore[untyped-decorator]
    def _mt_came_apply_kernel(  # type: ignore[no-untyped-def]
        addr, geo, items, cfbuf, scal, p0, m0, seed_base,
        HAS_DECAY: tl.constexpr, SR: tl.constexpr, ALIGNED: tl.constexpr, SUB: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """`p ← p - wd·lr·p - m · rrs_i · cR_j` in fp32, stored in p's dtype (SR for bf16).

        `rrs_i = lr / √(R_i / mean(R))` (scal[mat] = (mean(R), lr, wd·lr, lr)); the decay is
        came-pytorch's `p.add_(p, alpha=-wd·lr)`.
        """
        pid = tl.program_id(0)
        mat = tl.load(items + pid * 2)
        r0 = tl.load(items + pid * 2 + 1)
        n = tl.load(geo + mat * _GEO + 0)
        m = tl.load(geo + mat * _GEO + 1)
        cf_off = tl.load(geo + mat * _GEO + 2)
        p_ptr = tl.load(addr + mat * 6 + 0).to(p0.dtype)
        m_ptr = tl.load(addr + mat * 6 + 1).to(m0.dtype)
        res_ptr = tl.load(addr + mat * 6 + 4).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            m = tl.multiple_of(m, 16)
            p_ptr = tl.multiple_of(p_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
        rows = r0 + tl.arange(0, SUB)
        row_mask = rows < n
        mean_res = tl.load(scal + mat * 4)
        lr = tl.load(scal + mat * 4 + 1)
        res = tl.load(res_ptr + rows, mask=row_mask, other=1.0)
        rrs = lr / tl.sqrt(res / mean_res)
        wd_lr = 0.0
        if HAS_DECAY:
            wd_lr = tl.load(scal + mat * 4 + 2)
        seed = 0
        if SR:
            seed = tensor_seed(seed_base, tl.load(geo + mat * _GEO + 8))
        for c0 in range(0, m, BLOCK_M):
            cols = c0 + tl.arange(0, BLOCK_M)
            col_mask = cols < m
            mask = row_mask[:, None] & col_mask[None, :]
            offs = rows[:, None].to(tl.int64) * m + cols[None, :]
            cr = tl.load(cfbuf + cf_off + cols, mask=col_mask, other=0.0)
            mom = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            upd = mom * rrs[:, None] * cr[None, :]
            store_update(p_ptr, offs, mask, p, upd, wd_lr, seed, HAS_DECAY, SR)

    def gpu_launch_configs() -> list[dict[str, Any]]:
        """Every launch `step_batch` makes on a GPU (for tools/gpu_compile.py).

        Gradient/parameter dtypes bf16, fp16, fp32; `exp_avg` fp32 or bf16 (`state_dtype`);
        aligned and unaligned batches; every flag. Also optim-adafactor's statistics,
        column and scalar kernels with CAME's table layout (6 addresses per matrix). The
        vector step's launches are listed by `_multi_vec`.
        """
        i64, f32 = torch.int64, torch.float32
        launches: list[dict[str, Any]] = []
        args: dict[str, Any]
        for dtype in (torch.bfloat16, torch.float16, f32):
            for aligned in (True, False):
                sub, bm, warps = launch_config(aligned, stats=True)
                opts = {"num_warps": warps}
                tile = {"ALIGNED": aligned, "SUB": sub, "BLOCK_M": bm}
                args = {"addr": i64, "geo": i64, "gaddr": i64, "items": i64, "colpart": f32,
                        "wpart": f32, "rpart": f32, "ppart": f32, "g0": dtype, "p0": dtype,
                        "beta2": 0.999, "eps1": 1e-30, "HAS_P": False, "NADDR": NADDR,
                        **tile}  # fmt: skip
                launches.append({"kernel": st._mt_stats_kernel, "args": args, "options": opts})
                sub, bm, warps = launch_config(aligned)
                opts = {"num_warps": warps}
                tile = {"ALIGNED": aligned, "SUB": sub, "BLOCK_M": bm}
                for m_dtype in (f32, torch.bfloat16):
                    args = {"addr": i64, "geo": i64, "gaddr": i64, "items": i64, "cfbuf": f32,
                            "scal": f32, "colpart": f32, "rpart": f32, "g0": dtype,
                            "m0": m_dtype, "beta1": 0.9, "beta3": 0.9999, "eps2": 1e-16,
                            **tile}  # fmt: skip
                    launches.append({"kernel": _mt_momentum_kernel, "args": args,
                                     "options": opts})  # fmt: skip
                    for has_decay in (False, True):
                        for sr in (False, True) if dtype == torch.bfloat16 else (False,):
                            args = {"addr": i64, "geo": i64, "items": i64, "cfbuf": f32,
                                    "scal": f32, "p0": dtype, "m0": m_dtype,
                                    "seed_base": 12345, "HAS_DECAY": has_decay, "SR": sr,
                                    **tile}  # fmt: skip
                            launches.append({"kernel": _mt_came_apply_kernel, "args": args,
                                             "options": opts})  # fmt: skip
        for col, has_w in ((3, True), (RES_COL, False)):
            args = {"addr": i64, "geo": i64, "items": i64, "colpart": f32, "wpart": f32,
                    "cfbuf": f32, "upart": f32, "beta2": 0.999, "eps1": 1e-30,
                    "col_mult": 0.81, "cf_scale": 1.0, "BLOCK_C": BLOCK_C, "NADDR": NADDR,
                    "COL": col, "HAS_W": has_w}  # fmt: skip
            launches.append({"kernel": st._mt_cols_kernel, "args": args,
                             "options": {"num_warps": 4}})  # fmt: skip
        return launches


# ---------------------------------------------------------------------------------- launcher
def fuse_vector(p: Tensor) -> bool:
    """Whether an unfactored parameter takes the batched vector step (optim-adafactor's rule)."""
    return vec.fusable(p)


def eligible(w: Work) -> bool:
    """Whether `w` can join a batch: a plain, non-empty 2-D matrix, or a fused vector."""
    if not w.factored:
        return w.state["exp_avg"].dtype in (torch.float32, torch.bfloat16)
    return af.eligible_matrix(w) and w.state["exp_avg"].dtype in (torch.float32, torch.bfloat16)  # type: ignore[arg-type]


def batch_key(w: Work) -> tuple[object, ...]:
    """Works with equal keys share one set of launches (options, step, dtypes, alignment)."""
    m = w.state["exp_avg"]
    if not w.factored:
        return ("vec", id(w.opts), w.step, w.param.dtype, w.grad.dtype, m.dtype)
    aligned = mt.aligned([w.param, w.grad, m])
    return (id(w.opts), w.step, w.param.dtype, w.grad.dtype, m.dtype, aligned)


def step_batch(opt: CAME, works: list[Work], cache: dict[tuple[object, ...], Any]) -> None:
    """One fused CAME step of every matrix in `works` (same `batch_key`): seven launches.

    Unfactored tensors (a batch of them) take `_multi_vec_kernels.step_vectors`: one launch.
    """
    w0 = works[0]
    if not w0.factored:
        step_vectors(opt, works, cache)
        return
    o, step, p0, g0, m0 = w0.opts, w0.step, w0.param, w0.grad, w0.state["exp_avg"]
    is_aligned = bool(batch_key(w0)[-1])
    sub, bm, warps = launch_config(is_aligned)
    keys = ("exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_res_col")
    mats = [(w.param, *(w.state[k] for k in keys)) for w in works]
    tables = mt.cached(cache, mats, [w.index for w in works], sub=sub, block_c=BLOCK_C)
    gaddr = tables.grad_addresses([w.grad for w in works])
    buf = tables.buf
    grid_a, grid_b, grid_c = (len(tables.a_items),), (len(tables.b_items),), (tables.n_mats,)
    tile = {"ALIGNED": is_aligned, "SUB": sub, "BLOCK_M": bm, "num_warps": warps}
    _, stats_bm, stats_warps = launch_config(is_aligned, stats=True)
    st._mt_stats_kernel[grid_a](
        tables.addr, tables.geo, gaddr, tables.a_items, buf["colpart"], buf["wpart"],
        buf["rpart"], buf["ppart"], g0, p0, o.beta2, o.eps1, HAS_P=False, NADDR=NADDR,
        ALIGNED=is_aligned, SUB=sub, BLOCK_M=stats_bm, num_warps=stats_warps,
    )  # fmt: skip
    corr2 = math.sqrt(o.second_moment_correction(step))  # rsqrt(c / (1-β2^t))
    st._mt_cols_kernel[grid_b](
        tables.addr, tables.geo, tables.b_items, buf["colpart"], buf["wpart"], buf["cf"],
        buf["upart"], o.beta2, o.eps1, 1.0, corr2, BLOCK_C=BLOCK_C, NADDR=NADDR, COL=3,
        HAS_W=True, num_warps=4,
    )  # fmt: skip
    st._mt_scalars_kernel[grid_c](
        tables.geo, buf["rpart"], buf["ppart"], buf["upart"], buf["scal"], buf["scal"], 1.0,
        0.0, o.clip_threshold, 1.0, 0.0, LR_TENSOR=False, HAS_P=False, CLIP=True,
        BLOCK_K=BLOCK_K, num_warps=4,
    )  # fmt: skip
    _mt_momentum_kernel[grid_a](
        tables.addr, tables.geo, gaddr, tables.a_items, buf["cf"], buf["scal"],
        buf["colpart"], buf["rpart"], g0, m0, o.beta1, o.beta3, o.eps2, **tile,
    )  # fmt: skip
    corr3 = math.sqrt(o.instability_correction(step))
    st._mt_cols_kernel[grid_b](
        tables.addr, tables.geo, tables.b_items, buf["colpart"], buf["wpart"], buf["cf"],
        buf["upart"], o.beta3, o.eps2, o.beta1 * o.beta1, corr3, BLOCK_C=BLOCK_C,
        NADDR=NADDR, COL=RES_COL, HAS_W=False, num_warps=4,
    )  # fmt: skip
    lr_tensor = isinstance(o.lr, Tensor)
    st._mt_scalars_kernel[grid_c](
        tables.geo, buf["rpart"], buf["ppart"], buf["upart"], buf["scal"],
        o.lr if lr_tensor else buf["scal"], 0.0 if lr_tensor else float(o.lr), 0.0, 1.0, 1.0,
        o.weight_decay, LR_TENSOR=lr_tensor, HAS_P=False, CLIP=False, BLOCK_K=BLOCK_K,
        num_warps=4,
    )  # fmt: skip
    sr = o.stochastic_rounding and p0.dtype == torch.bfloat16
    seed_base = (opt._sr_seed + 1_000_003 * step) % (2**31 - 1)
    _mt_came_apply_kernel[(len(tables.d_items),)](
        tables.addr, tables.geo, tables.d_items, buf["cf"], buf["scal"], p0, m0, seed_base,
        HAS_DECAY=o.weight_decay != 0, SR=sr, **tile,
    )  # fmt: skip


def bytes_per_element(g: torch.dtype, p: torch.dtype, m: torch.dtype, rows_per_item: int) -> float:
    """DRAM bytes per element of a batched CAME step, computed from the kernels (not measured).

    G (statistics; the second sweep counted as an L2 hit) + G + 2M (momentum) + M + 2P
    (apply), plus the column partials: g², g²/r and d², 4 B each, written and read once
    per row chunk (`24 / rows_per_item`).
    """

    def size(dtype: torch.dtype) -> int:
        return torch.empty((), dtype=dtype).element_size()

    return 2 * size(g) + 3 * size(m) + 2 * size(p) + 24 / rows_per_item
