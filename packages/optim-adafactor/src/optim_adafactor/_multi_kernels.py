# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""Multi-tensor fused Adafactor step: four Triton launches per group of matrices of a batch.

A batch is every unsharded 2-D parameter of a step on the fused path with the same options,
step and dtypes (usually a whole param group). Each matrix is a row of the tables of
`_multi_tables`, so the number of launches does not grow with the number of parameters. The
statistics kernels (launches 1-3) live in `_multi_stats_kernels`, shared with optim-came; this
module adds the apply kernel and `step_batch`, which lists the four launches.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from optim_adafactor import _multi_tables as mt
from optim_adafactor import _multi_vec_kernels as vec

if TYPE_CHECKING:
    from optim_adafactor._torch_path import Work

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None

BLOCK_M = 64 if _INTERPRET else 256  # columns of a tile (aligned rows)
BLOCK_C = 16  # columns of a tile of the column kernel
BLOCK_I = 4 if _INTERPRET else 64  # row items of a tile of the column kernel
BLOCK_K = 16 if _INTERPRET else 128  # partials summed per iteration of the scalar kernel
NUM_WARPS = 8
STAGES = 3  # software-pipelined loads of the row-item loops (`tl.range(num_stages=...)`)


def launch_config(aligned: bool, *, stats: bool = False) -> tuple[int, int, int]:
    """(SUB, BLOCK_M, num_warps) of the tiles: SUB rows x BLOCK_M columns.

    Aligned rows: 8 x 256 on 8 warps (16-byte vector loads), the statistics kernels (`stats`)
    8 x 128 on 4 warps. Unaligned rows (columns not a multiple of 16, or an unaligned start)
    make every load a scalar load with its own address: 16 x 32 on 4 warps. Larger tiles
    spilled registers (ptxas evidence in benchmarks/RESULTS.md). The aligned or unaligned SUB
    is also the row tile of the work items (`_multi_tables.rows_per_item`).
    """
    if aligned:
        return (8, BLOCK_M // 2, 4) if stats else (8, BLOCK_M, NUM_WARPS)
    return 16, max(16, BLOCK_M // 8), 4


def apply_tile(aligned: bool, *, quant: bool) -> tuple[int, int, int]:
    """(SUB, BLOCK_M, num_warps) of the apply kernel (`launch_config`'s, or for int8 whole blocks).

    An int8 momentum takes tiles of whole 128-column blocks on 4 warps: 8 x 128 (aligned) or
    4 x 128 (unaligned). That apply decodes, encodes and stores the parameter; at 8 x 256 on 8
    warps it spilled 8-32 bytes on sm_80/sm_90 (tools/gpu_compile.py, triton 3.7.1). 8 x 128
    is the tile of optim-came's momentum kernel, which decodes and encodes too, and 4 x 128 its
    unaligned apply tile (`quant.quant_tile`).
    """
    if quant:
        return (8, 128, 4) if aligned else (4, 128, 4)
    return launch_config(aligned)


def apply_maxnreg(aligned: bool, *, quant: bool) -> int | None:
    """Register cap (`maxnreg`) of an apply launch; None: ptxas's own choice.

    The int8 apply on aligned rows with fp32 gradients and parameters: ptxas's own choice on
    sm_80 is 96 registers with 16 bytes spilled; capped at 128 (4 blocks of 128 threads per
    SM) it spills nothing, as the other int8 launches, which take 72-128 registers anyway
    (tools/gpu_compile.py, triton 3.7.1).
    """
    return 128 if quant and aligned else None


def stages(aligned: bool) -> int:
    """`num_stages` of the row-item loops: 3 (loads staged in shared memory) for aligned rows.

    Unaligned rows (scalar loads) take 1: at 3 and 2, ptxas spilled 8-24 bytes in some apply
    and statistics kernels on sm_80/sm_90 (tools/gpu_compile.py).
    """
    return STAGES if aligned else 1


if HAS_TRITON:
    import triton
    import triton.language as tl

    from optim_adafactor._jit_helpers import row_item, span, sr_counters, store_update, tile
    from optim_adafactor._multi_stats_kernels import (
        _GEO,
        _MOM,
        _P,
        _ROW,
        _mt_cols_kernel,
        _mt_scalars_kernel,
        _mt_stats_kernel,
        apply_scalars,
    )
    from optim_adafactor._quant_kernels import load_momentum, quant_args, store_momentum

    @triton.jit  # type: ignore[untyped-decorator]
    def _mt_apply_kernel(  # type: ignore[no-untyped-def]
        addr, geo, gaddr, items, cfbuf, scal, g0, p0, m0, beta1, seed_base,
        HAS_M: tl.constexpr, HAS_DECAY: tl.constexpr, SR: tl.constexpr, ALIGNED: tl.constexpr,
        SUB: tl.constexpr, BLOCK_M: tl.constexpr, STAGES: tl.constexpr,
        NADDR: tl.constexpr = 4, QUANT: tl.constexpr = False, QSR: tl.constexpr = False,
    ):  # fmt: skip
        """`m = β1 m + g·rs_i·cf_j`; `p = p - wd·lr_t·p - (m or g·rs_i·cf_j)` in p's dtype.

        One row item per program, streamed (`evict_first`: nothing is read twice).
        `rs_i = scale / √(r_i / mean(r))`. The decay is `p - wd·lr_t·p` (HF's form). With SR
        the bf16 store is stochastically rounded, seeded as `FactoredOptimizer._kernel_seed`.
        QUANT: `m` is int8 codes with per-block scales (address 4 of the matrix, NADDR = 5),
        decoded after the load and re-encoded (QSR: stochastically, seeded as the PyTorch path)
        before the store, in the same pass; BLOCK_M is a multiple of 128.
        """
        mat, r0, r1, m, cf_off = row_item(items, geo, _GEO)
        g_ptr = tl.load(gaddr + mat).to(g0.dtype)
        p_ptr = tl.load(addr + mat * NADDR + _P).to(p0.dtype)
        m_ptr = tl.load(addr + mat * NADDR + _MOM).to(m0.dtype)
        row_ptr = tl.load(addr + mat * NADDR + _ROW).to(tl.pointer_type(tl.float32))
        q_ptr, qseed = quant_args(addr, geo, mat, seed_base, NADDR, QUANT, QSR)
        n_blocks = tl.cdiv(m, 128)
        if ALIGNED:
            # `m` reloaded: a hint on a helper's return value is lost when the helper is
            # inlined, and without it every load and store of the tile is scalar
            m = tl.multiple_of(tl.load(geo + mat * _GEO + 1), 16)
            g_ptr = tl.multiple_of(g_ptr, 16)
            p_ptr = tl.multiple_of(p_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
        mean_r, scale, wd_lr, seed = apply_scalars(scal, geo, mat, seed_base, HAS_DECAY, SR)
        for s in range(r0, r1, SUB):
            rows, row_mask = span(s, r1, SUB)
            r = tl.load(row_ptr + rows, mask=row_mask, other=1.0)
            rs = scale / tl.sqrt(r / mean_r)
            for c0 in tl.range(0, m, BLOCK_M, num_stages=STAGES):
                cols, col_mask = span(c0, m, BLOCK_M)
                mask, offs = tile(rows, row_mask, cols, col_mask, m)
                g = tl.load(g_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
                cf = tl.load(cfbuf + cf_off + cols, mask=col_mask, other=0.0)
                upd = g.to(tl.float32) * rs[:, None] * cf[None, :]
                if QUANT:  # masked lanes: g = 0 and the codes load as 0, so m = 0 (absmax)
                    srow = tl.where(row_mask, rows.to(tl.int64) * n_blocks, -1)
                    mom = load_momentum(m_ptr, q_ptr, offs, mask, srow, c0, n_blocks, True, SUB,
                                        BLOCK_M)  # fmt: skip
                    mom = beta1 * mom + upd
                    store_momentum(mom, m_ptr, q_ptr, offs, mask, srow, c0, n_blocks, qseed, True,
                                   QSR, SUB, BLOCK_M)  # fmt: skip
                    upd = mom
                elif HAS_M:
                    mom = tl.load(m_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
                    mom = beta1 * mom + upd
                    tl.store(m_ptr + offs, mom, mask=mask)
                    upd = mom
                p = tl.load(p_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
                ctr = sr_counters(rows, c0, m, BLOCK_M)
                store_update(p_ptr, offs, mask, p.to(tl.float32), upd, wd_lr, seed, ctr,
                             HAS_DECAY, SR)  # fmt: skip

    def gpu_launch_configs() -> list[dict[str, Any]]:
        """Every launch `step_batch` makes on a GPU (for tools/gpu_compile.py).

        Parameter/gradient dtypes bf16, fp16 and fp32, aligned and unaligned batches (the tile
        and `tl.multiple_of` hints differ), every flag combination, the momentum fp32 or int8
        (nearest and stochastic codes). Tables are int64, buffers and statistics fp32.
        """
        i64, f32 = torch.int64, torch.float32
        launches: list[dict[str, Any]] = []
        for dtype in (torch.bfloat16, torch.float16, f32):
            for aligned in (True, False):
                sub, bm, warps = launch_config(aligned, stats=True)
                opts = {"num_warps": warps}
                tile = {"ALIGNED": aligned, "SUB": sub, "BLOCK_M": bm, "STAGES": stages(aligned)}
                args: dict[str, Any]
                for has_p in (False, True):
                    args = {"addr": i64, "geo": i64, "gaddr": i64, "items": i64, "colpart": f32,
                            "wpart": f32, "rpart": f32, "ppart": f32, "g0": dtype, "p0": dtype,
                            "beta2": 0.999, "eps1": 1e-30, "HAS_P": has_p, "NADDR": 4,
                            **tile}  # fmt: skip
                    launches.append({"kernel": _mt_stats_kernel, "args": args, "options": opts})
                # momentum: none, fp32, int8 with nearest and stochastic codes
                for has_m, quant, qsr in ((False,) * 3, (True, False, False), (True, True, False),
                                          (True, True, True)):  # fmt: skip
                    sub, bm, warps = apply_tile(aligned, quant=quant)
                    tile = {"ALIGNED": aligned, "SUB": sub, "BLOCK_M": bm,
                            "STAGES": stages(aligned), "NADDR": 4 + quant, "QUANT": quant,
                            "QSR": qsr}  # fmt: skip
                    for has_decay in (False, True):
                        for sr in (False, True) if dtype == torch.bfloat16 else (False,):
                            args = {"addr": i64, "geo": i64, "gaddr": i64, "items": i64,
                                    "cfbuf": f32, "scal": f32, "g0": dtype, "p0": dtype,
                                    "m0": torch.int8 if quant else f32, "beta1": 0.9,
                                    "seed_base": 12345, "HAS_M": has_m,
                                    "HAS_DECAY": has_decay, "SR": sr, **tile}  # fmt: skip
                            opts = {"num_warps": warps}
                            cap = apply_maxnreg(aligned, quant=quant)
                            opts |= {"maxnreg": cap} if cap is not None else {}
                            launches.append({"kernel": _mt_apply_kernel, "args": args,
                                             "options": opts})  # fmt: skip
        launches += [
            cols_launch_config(naddr=4, col=3, has_w=True, aligned=a) for a in (True, False)
        ]
        for lr_tensor in (False, True):
            for has_p in (False, True):
                for clip in (False, True):
                    args = {"geo": i64, "rpart": f32, "ppart": f32, "upart": f32, "scal": f32,
                            "lr_ptr": f32, "lr": 1e-3, "eps2": 1e-3, "clip_threshold": 1.0,
                            "coef": 0.1, "weight_decay": 0.01, "LR_TENSOR": lr_tensor,
                            "HAS_P": has_p, "CLIP": clip, "BLOCK_K": BLOCK_K}  # fmt: skip
                    launches.append({"kernel": _mt_scalars_kernel, "args": args,
                                     "options": {"num_warps": 4}})  # fmt: skip
        return launches

    def cols_launch_config(*, naddr: int, col: int, has_w: bool, aligned: bool) -> dict[str, Any]:
        """The column kernel's launch for a table layout of `naddr` addresses per matrix."""
        i64, f32 = torch.int64, torch.float32
        args = {"addr": i64, "geo": i64, "items": i64, "colpart": f32, "wpart": f32,
                "cfbuf": f32, "upart": f32, "beta2": 0.999, "eps1": 1e-30, "col_mult": 1.0,
                "cf_scale": 1.0, "BLOCK_C": BLOCK_C, "BLOCK_I": BLOCK_I, "NADDR": naddr,
                "COL": col, "HAS_W": has_w, "ALIGNED": aligned}  # fmt: skip
        return {"kernel": _mt_cols_kernel, "args": args, "options": {"num_warps": 4}}


# ---------------------------------------------------------------------------------- launcher
def fuse_vector(p: Tensor) -> bool:
    """Whether an unfactored parameter takes the batched vector step (`_multi_vec`)."""
    return vec.fusable(p)


def eligible(w: Work) -> bool:
    """Whether `w` can join a batch: a matrix (`eligible_matrix`) or a fused vector."""
    return eligible_matrix(w) or not w.factored  # unfactored works are fused only if fusable


def eligible_matrix(w: Work) -> bool:
    """Whether `w` can join a batch: a non-empty 2-D matrix with a contiguous gradient."""
    g = w.grad
    return (
        type(g) is Tensor  # plain tensors: a DTensor's data_ptr is not its storage's
        and type(w.param) in (Tensor, torch.nn.Parameter)
        and w.param.dim() == 2
        and w.param.numel() > 0
        and g.is_contiguous()
        and g.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and w.param.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def batch_key(w: Work) -> tuple[object, ...]:
    """Works with equal keys share one set of launches (options, step, dtypes, alignment)."""
    if not w.factored:
        return ("vec", id(w.opts), w.step, w.param.dtype, w.grad.dtype)
    m = w.state.get("exp_avg")
    tensors = [w.param, w.grad] + ([m] if m is not None else [])
    m_dtype = None if m is None else m.dtype
    return (id(w.opts), w.step, w.param.dtype, w.grad.dtype, m_dtype, mt.aligned(tensors))


def tables_for(
    cache: dict[tuple[object, ...], Any], mats: Sequence[Sequence[Tensor]], works: Sequence[Any],
    is_aligned: bool,
) -> mt.Tables:  # fmt: skip
    """The cached tables of a batch, for the tiles of `launch_config(is_aligned)`.

    The row partials (optim-came's momentum kernel) are per tile of the statistics config.
    """
    sub, _, _ = launch_config(is_aligned)
    _, stats_bm, _ = launch_config(is_aligned, stats=True)
    indices = [w.index for w in works]
    return mt.cached(cache, mats, indices, sub=sub, block_m=stats_bm, block_c=BLOCK_C)


def launch_stats(
    tables: mt.Tables, group: mt.Group, gaddr: Tensor, g0: Tensor, p0: Tensor, *,
    beta2: float, eps1: float, has_p: bool, naddr: int, is_aligned: bool,
) -> None:  # fmt: skip
    """Launch `_mt_stats_kernel` on the row items of `group` (row EMA, column partials)."""
    buf = tables.buf
    sub, bm, warps = launch_config(is_aligned, stats=True)
    nbytes = group.row_work.total * (mt.size(g0.dtype) + (mt.size(p0.dtype) if has_p else 0))
    nbytes += 8 * group.partial_floats + 8 * group.n_rows
    if not mt.planned(_mt_stats_kernel, group.row_work, nbytes):
        _mt_stats_kernel[(len(group.rows),)](
            group.addr, group.geo, gaddr, group.rows, buf["colpart"], buf["wpart"],
            buf["rpart"], buf["ppart"], g0, p0, beta2, eps1, HAS_P=has_p, ALIGNED=is_aligned,
            SUB=sub, BLOCK_M=bm, NADDR=naddr, STAGES=stages(is_aligned), num_warps=warps,
        )  # fmt: skip


def launch_cols(
    tables: mt.Tables, group: mt.Group, *, beta2: float, eps1: float, col_mult: float,
    cf_scale: float, naddr: int, col: int, has_w: bool, is_aligned: bool,
) -> None:  # fmt: skip
    """Launch `_mt_cols_kernel` on the column items of `group` (column EMA, factors).

    `is_aligned` (the batch's `mt.aligned`, which implies every column count is a multiple
    of 16) turns on the kernel's `tl.multiple_of` hints.
    """
    buf = tables.buf
    nbytes = (8 if has_w else 4) * group.partial_floats + 12 * group.n_cols
    if not mt.planned(_mt_cols_kernel, group.col_work, nbytes):
        _mt_cols_kernel[(len(group.cols),)](
            group.addr, group.geo, group.cols, buf["colpart"], buf["wpart"], buf["cf"],
            buf["upart"], beta2, eps1, col_mult, cf_scale, BLOCK_C=BLOCK_C, BLOCK_I=BLOCK_I,
            NADDR=naddr, COL=col, HAS_W=has_w, ALIGNED=is_aligned, num_warps=4,
        )  # fmt: skip


def launch_scalars(
    tables: mt.Tables, group: mt.Group, lr: float | Tensor, *, eps2: float,
    clip_threshold: float | None, coef: float, weight_decay: float, has_p: bool,
) -> None:  # fmt: skip
    """Launch `_mt_scalars_kernel`: per matrix mean(r), the clipped scale, wd·lr_t and lr_t."""
    buf = tables.buf
    scal = group.scal
    lr_tensor = isinstance(lr, Tensor)
    work = group.mat_work
    clip = 1.0 if clip_threshold is None else clip_threshold
    if not mt.planned(_mt_scalars_kernel, work, 4 * work.total + 16 * group.n_mats):
        _mt_scalars_kernel[(group.n_mats,)](
            group.geo, buf["rpart"], buf["ppart"], buf["upart"], scal, lr if lr_tensor else scal,
            0.0 if lr_tensor else float(lr), eps2, clip, coef, weight_decay,
            LR_TENSOR=lr_tensor, HAS_P=has_p, CLIP=clip_threshold is not None, BLOCK_K=BLOCK_K,
            num_warps=4,
        )  # fmt: skip


def step_batch(opt: vec.Stepping, works: list[Work], cache: dict[tuple[object, ...], Any]) -> None:
    """One fused step of every matrix in `works` (same `batch_key`): four launches per group.

    For a matrix `g` of shape (n, m):

    1. `_mt_stats_kernel`, per row item: the row EMA `r` and the column partials of g² and of
       g²/r, which give Σu² without another pass over g:
       `Σ u² = mean(r) · Σ_j (Σ_i g²_ij / r_i) / c_j`;
    2. `_mt_cols_kernel`, per column item: the column EMA `c`, `cf = 1/√c`, partials of Σu²;
    3. `_mt_scalars_kernel`, per matrix: mean(r), RMS(p), `lr_t`, the clip and the row scale;
    4. `_mt_apply_kernel`, per row item: `m = β1 m + g·rs_i·cf_j`,
       `p = p - wd·lr_t·p - (m or g·rs_i·cf_j)`, stored in p's dtype.

    Unfactored tensors (a batch of them) take `_multi_vec_kernels.step_vectors`: one launch.
    """
    w0 = works[0]
    if not w0.factored:
        vec.step_vectors(opt, works, cache)
        return
    o, step, p0, g0 = w0.opts, w0.step, w0.param, w0.grad
    is_aligned = bool(batch_key(w0)[-1])
    has_m = o.beta1 is not None
    m0 = w0.state["exp_avg"] if has_m else p0
    quant = m0.dtype == torch.int8  # codes + scales (address 4): tiles of whole 128-blocks
    sub, bm, warps = apply_tile(is_aligned, quant=quant)
    naddr = 5 if quant else 4
    mats = [
        (w.param, w.state["exp_avg"] if has_m else w.param, w.state["exp_avg_sq_row"],
         w.state["exp_avg_sq_col"], *([w.state["exp_avg_scale"]] if quant else []))
        for w in works
    ]  # fmt: skip
    tables = tables_for(cache, mats, works, is_aligned)
    buf = tables.buf
    beta2, eps1 = o.beta2(step), w0.eps1
    coef = (1.0 - o.beta1 if has_m else 1.0) * (-1.0 if o.maximize else 1.0)
    sr = o.stochastic_rounding and p0.dtype == torch.bfloat16
    seed_base = (opt._sr_seed + 1_000_003 * step) % (2**31 - 1)
    elem = mt.size(g0.dtype) + 2 * mt.size(p0.dtype) + (2 * mt.size(m0.dtype) if has_m else 0.0)
    elem += 8 / 128 if quant else 0.0  # block scales, read and written
    for group, gaddr in zip(tables.groups, tables.gaddr([w.grad for w in works]), strict=True):
        launch_stats(tables, group, gaddr, g0, p0, beta2=beta2, eps1=eps1,
                     has_p=o.needs_param_rms, naddr=naddr, is_aligned=is_aligned)  # fmt: skip
        launch_cols(tables, group, beta2=beta2, eps1=eps1, col_mult=1.0, cf_scale=1.0,
                    naddr=naddr, col=3, has_w=True, is_aligned=is_aligned)  # fmt: skip
        launch_scalars(tables, group, o.relative_step_size(step), eps2=o.eps2,
                       clip_threshold=o.clip_threshold, coef=coef, weight_decay=o.weight_decay,
                       has_p=o.needs_param_rms)  # fmt: skip
        if not mt.planned(_mt_apply_kernel, group.row_work, elem * group.row_work.total):
            _mt_apply_kernel[(len(group.rows),)](
                group.addr, group.geo, gaddr, group.rows, buf["cf"], group.scal,
                g0, p0, m0, o.beta1 if has_m else 0.0, seed_base, HAS_M=has_m,
                HAS_DECAY=o.weight_decay != 0, SR=sr, ALIGNED=is_aligned, SUB=sub, BLOCK_M=bm,
                STAGES=stages(is_aligned), NADDR=naddr, QUANT=quant,
                QSR=quant and o.stochastic_rounding, num_warps=warps,
                maxnreg=apply_maxnreg(is_aligned, quant=quant),
            )  # fmt: skip
    for i, w in enumerate(works):
        opt._step_sizes[w.param] = (buf["scal"], i)
