# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""Multi-tensor fused Adafactor step: four Triton launches for all the matrices of a batch.

A batch is every unsharded 2-D parameter of a step on the fused path with the same options,
step and dtypes (usually all of a param group). Each matrix is a row of the work-item tables of
`_multi_tables` (device addresses cast to typed pointers in the kernels), so the number of
launches does not grow with the number of parameters. The kernels of steps 1-3 are in
`_multi_stats` (optim-came's multi-tensor step launches them too). For a matrix `g` of shape
(n, m):

1. `_mt_stats_kernel`, one program per chunk of rows: sweep 1 reads a block of `SUB` rows and
   gives their row sums of g² (and Σ p²), hence the new row EMA `r_i`, written in place;
   sweep 2 re-reads the same block (just read: from L2, not DRAM) for the column partial sums
   of g² and of g²/r_i. The second gives Σu² without another pass over g:
   `Σ u² = Σ_ij g²_ij · mean(r)/r_i · 1/c_j = mean(r) · Σ_j (Σ_i g²_ij / r_i) / c_j`
   (the mat-vec identity of `_torch_path.update_sumsq`, with the row factor folded in first).
2. `_mt_cols_kernel`, one program per column tile: sums the row-chunk partials (fixed order:
   deterministic, no atomics), the column EMA `c_j` (in place), `cf = 1/√c` and a partial of
   `Σ_j W_j / c_j`.
3. `_mt_scalars_kernel`, one program per matrix: mean(r), Σu², RMS(p), the step size `lr_t`,
   the clip and the row scale, on the device (no host sync).
4. `_mt_apply_kernel`, one program per `SUB` rows: `m = β1 m + g·rs_i·cf_j`,
   `p = p - wd·lr_t·p - (m or g·rs_i·cf_j)`, stored in p's dtype (optional stochastic rounding).

DRAM bytes per element (computed from the kernels, G/P/M = bytes of g/p/m): pass 1 reads G
(+P with parameter scaling), pass 4 reads G, P (and M) and writes P (and M); the O(n + m)
partials add `16 / rows_per_item` (at most 512 rows per item: 0.03 B). Adafactor with
momentum, bf16 g/p, fp32 m: 2G + 2P + 2M = 16 B (+2 with parameter scaling), against 14 B
for one read of g and read/write of p and m (`bytes_per_element`).
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from optim_adafactor import _multi_tables as mt
from optim_adafactor import _multi_vec_kernels as vec

if TYPE_CHECKING:
    from optim_adafactor._torch_path import Work
    from optim_adafactor.optimizer import Adafactor

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None

BLOCK_M = 64 if _INTERPRET else 256  # columns of a tile (aligned rows)
BLOCK_C = 64 if _INTERPRET else 256  # columns of a column work item
BLOCK_K = 16 if _INTERPRET else 128  # partials summed per iteration of the scalar kernel
NUM_WARPS = 8


def launch_config(aligned: bool, *, stats: bool = False) -> tuple[int, int, int]:
    """(SUB, BLOCK_M, num_warps) of the tiles: SUB rows x BLOCK_M columns.

    Aligned rows: 8 x 256 on 8 warps (8 elements per thread, 16-byte vector loads); the
    statistics kernels (`stats`) 8 x 128 on 4 warps, because ptxas spilled 12-20 bytes of
    the fp32 statistics kernel on sm_80 at 8 x 256 on 8 or 4 warps. Unaligned
    rows (columns not a multiple of 16, or an unaligned start) make every load a scalar load
    with its own 64-bit address: 16 x 32 on 4 warps. With 16 x 256 (aligned) and 16 x 64
    (unaligned) CAME's momentum kernel spilled 12-32 bytes on sm_80/sm_90; these need at most
    ~100 registers in every multi-tensor kernel (tools/gpu_compile.py). SUB is also the rows
    of an apply work item.
    """
    if aligned:
        return (8, BLOCK_M // 2, 4) if stats else (8, BLOCK_M, NUM_WARPS)
    return 16, max(16, BLOCK_M // 8), 4


if HAS_TRITON:
    import triton
    import triton.language as tl

    from optim_adafactor._kernels import store_update, tensor_seed
    from optim_adafactor._multi_stats_kernels import (
        _GEO,
        _MOM,
        _NADDR,
        _P,
        _ROW,
        _mt_cols_kernel,
        _mt_scalars_kernel,
        _mt_stats_kernel,
    )

    @triton.jit  # type: ignore[untyped-decorator]
    def _mt_apply_kernel(  # type: ignore[no-untyped-def]
        addr, geo, gaddr, items, cfbuf, scal, g0, p0, beta1, seed_base,
        HAS_M: tl.constexpr, HAS_DECAY: tl.constexpr, SR: tl.constexpr, ALIGNED: tl.constexpr,
        SUB: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """`m = β1 m + g·rs_i·cf_j`; `p = p - wd·lr_t·p - (m or g·rs_i·cf_j)` in p's dtype.

        `rs_i = scale / √(r_i / mean(r))`. The decay is `p - wd·lr_t·p` (HF's form). With SR the
        bf16 store is stochastically rounded, seeded as `FactoredOptimizer._kernel_seed`.
        """
        pid = tl.program_id(0)
        mat = tl.load(items + pid * 2)
        r0 = tl.load(items + pid * 2 + 1)
        n = tl.load(geo + mat * _GEO + 0)
        m = tl.load(geo + mat * _GEO + 1)
        cf_off = tl.load(geo + mat * _GEO + 2)
        g_ptr = tl.load(gaddr + mat).to(g0.dtype)
        p_ptr = tl.load(addr + mat * _NADDR + _P).to(p0.dtype)
        m_ptr = tl.load(addr + mat * _NADDR + _MOM).to(tl.pointer_type(tl.float32))
        row_ptr = tl.load(addr + mat * _NADDR + _ROW).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            m = tl.multiple_of(m, 16)
            g_ptr = tl.multiple_of(g_ptr, 16)
            p_ptr = tl.multiple_of(p_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
        rows = r0 + tl.arange(0, SUB)
        row_mask = rows < n
        mean_r = tl.load(scal + mat * 4)
        scale = tl.load(scal + mat * 4 + 1)
        r = tl.load(row_ptr + rows, mask=row_mask, other=1.0)
        rs = scale / tl.sqrt(r / mean_r)
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
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            cf = tl.load(cfbuf + cf_off + cols, mask=col_mask, other=0.0)
            upd = g * rs[:, None] * cf[None, :]
            if HAS_M:
                mom = tl.load(m_ptr + offs, mask=mask, other=0.0)
                mom = beta1 * mom + upd
                tl.store(m_ptr + offs, mom, mask=mask)
                upd = mom
            p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            store_update(p_ptr, offs, mask, p, upd, wd_lr, seed, HAS_DECAY, SR)

    def gpu_launch_configs() -> list[dict[str, Any]]:
        """Every launch `step_batch` makes on a GPU (for tools/gpu_compile.py).

        Parameter/gradient dtypes bf16, fp16 and fp32, aligned and unaligned batches (the tile
        and `tl.multiple_of` hints differ), every flag combination. Tables are int64, buffers
        and state fp32.
        """
        i64, f32 = torch.int64, torch.float32
        launches: list[dict[str, Any]] = []
        for dtype in (torch.bfloat16, torch.float16, f32):
            for aligned in (True, False):
                sub, bm, warps = launch_config(aligned, stats=True)
                opts = {"num_warps": warps}
                tile = {"ALIGNED": aligned, "SUB": sub, "BLOCK_M": bm}
                args: dict[str, Any]
                for has_p in (False, True):
                    args = {"addr": i64, "geo": i64, "gaddr": i64, "items": i64, "colpart": f32,
                            "wpart": f32, "rpart": f32, "ppart": f32, "g0": dtype, "p0": dtype,
                            "beta2": 0.999, "eps1": 1e-30, "HAS_P": has_p, "NADDR": 4,
                            **tile}  # fmt: skip
                    launches.append({"kernel": _mt_stats_kernel, "args": args, "options": opts})
                sub, bm, warps = launch_config(aligned)
                opts = {"num_warps": warps}
                tile = {"ALIGNED": aligned, "SUB": sub, "BLOCK_M": bm}
                for has_m in (False, True):
                    for has_decay in (False, True):
                        for sr in (False, True) if dtype == torch.bfloat16 else (False,):
                            args = {"addr": i64, "geo": i64, "gaddr": i64, "items": i64,
                                    "cfbuf": f32, "scal": f32, "g0": dtype, "p0": dtype,
                                    "beta1": 0.9, "seed_base": 12345, "HAS_M": has_m,
                                    "HAS_DECAY": has_decay, "SR": sr, **tile}  # fmt: skip
                            launches.append({"kernel": _mt_apply_kernel, "args": args,
                                             "options": opts})  # fmt: skip
        args = {"addr": i64, "geo": i64, "items": i64, "colpart": f32, "wpart": f32,
                "cfbuf": f32, "upart": f32, "beta2": 0.999, "eps1": 1e-30, "col_mult": 1.0,
                "cf_scale": 1.0, "BLOCK_C": BLOCK_C, "NADDR": 4, "COL": 3,
                "HAS_W": True}  # fmt: skip
        launches.append({"kernel": _mt_cols_kernel, "args": args, "options": {"num_warps": 4}})
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
    tensors = [w.param, w.grad] + ([w.state["exp_avg"]] if "exp_avg" in w.state else [])
    return (id(w.opts), w.step, w.param.dtype, w.grad.dtype, mt.aligned(tensors))


def step_batch(opt: Adafactor, works: list[Work], cache: dict[tuple[object, ...], Any]) -> None:
    """One fused step of every matrix in `works` (same `batch_key`): four launches.

    Unfactored tensors (a batch of them) take `_multi_vec_kernels.step_vectors`: one launch.
    """
    w0 = works[0]
    if not w0.factored:
        vec.step_vectors(opt, works, cache)
        return
    o, step, p0, g0 = w0.opts, w0.step, w0.param, w0.grad
    is_aligned = bool(batch_key(w0)[-1])
    sub, bm, warps = launch_config(is_aligned)
    has_m = o.beta1 is not None
    mats = [
        (w.param, w.state["exp_avg"] if has_m else w.param, w.state["exp_avg_sq_row"],
         w.state["exp_avg_sq_col"])
        for w in works
    ]  # fmt: skip
    tables = mt.cached(cache, mats, [w.index for w in works], sub=sub, block_c=BLOCK_C)
    gaddr = tables.grad_addresses([w.grad for w in works])
    buf = tables.buf
    beta2, eps1 = o.beta2(step), w0.eps1
    grid_a, grid_b = (len(tables.a_items),), (len(tables.b_items),)
    _, stats_bm, stats_warps = launch_config(is_aligned, stats=True)
    _mt_stats_kernel[grid_a](
        tables.addr, tables.geo, gaddr, tables.a_items, buf["colpart"], buf["wpart"],
        buf["rpart"], buf["ppart"], g0, p0, beta2, eps1, HAS_P=o.needs_param_rms,
        ALIGNED=is_aligned, SUB=sub, BLOCK_M=stats_bm, NADDR=4, num_warps=stats_warps,
    )  # fmt: skip
    _mt_cols_kernel[grid_b](
        tables.addr, tables.geo, tables.b_items, buf["colpart"], buf["wpart"], buf["cf"],
        buf["upart"], beta2, eps1, 1.0, 1.0, BLOCK_C=BLOCK_C, NADDR=4, COL=3, HAS_W=True,
        num_warps=4,
    )  # fmt: skip
    rel = o.relative_step_size(step)
    lr_tensor = isinstance(rel, Tensor)
    coef = (1.0 - o.beta1 if has_m else 1.0) * (-1.0 if o.maximize else 1.0)
    clip = o.clip_threshold
    _mt_scalars_kernel[(tables.n_mats,)](
        tables.geo, buf["rpart"], buf["ppart"], buf["upart"], buf["scal"],
        rel if lr_tensor else buf["scal"], 0.0 if lr_tensor else float(rel), o.eps2,
        1.0 if clip is None else clip, coef, o.weight_decay, LR_TENSOR=lr_tensor,
        HAS_P=o.needs_param_rms, CLIP=clip is not None, BLOCK_K=BLOCK_K, num_warps=4,
    )  # fmt: skip
    sr = o.stochastic_rounding and p0.dtype == torch.bfloat16
    seed_base = (opt._sr_seed + 1_000_003 * step) % (2**31 - 1)
    _mt_apply_kernel[(len(tables.d_items),)](
        tables.addr, tables.geo, gaddr, tables.d_items, buf["cf"], buf["scal"], g0, p0,
        o.beta1 if has_m else 0.0, seed_base, HAS_M=has_m, HAS_DECAY=o.weight_decay != 0,
        SR=sr, ALIGNED=is_aligned, SUB=sub, BLOCK_M=bm, num_warps=warps,
    )  # fmt: skip
    for i, w in enumerate(works):
        opt._step_sizes[w.param] = (buf["scal"], i)


def bytes_per_element(
    g: torch.dtype, p: torch.dtype, *, momentum: bool, param_scale: bool, rows_per_item: int
) -> float:
    """DRAM bytes per element of a batched step, computed from the kernels (not measured).

    Pass 1 reads g (+p with parameter scaling); its second sweep re-reads the row block it
    just read, counted as an L2 hit. Pass 4 reads g, p (m) and writes p (m). The column
    partials (two fp32 per column per item, written then read) add `16 / rows_per_item`.
    """
    gb = torch.empty((), dtype=g).element_size()
    pb = torch.empty((), dtype=p).element_size()
    total = 2 * gb + 2 * pb + (pb if param_scale else 0) + (8 if momentum else 0)
    return total + 16 / rows_per_item
