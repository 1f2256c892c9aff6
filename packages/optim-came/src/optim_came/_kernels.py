# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""Fused Triton kernels for the factored (>= 2-D) CAME step, launchers and references.

CAME (Luo et al., ACL 2023, arXiv:2307.02047) needs four streaming passes over a (B, n, m)
tensor because two global reductions (the update RMS for the clip, and the instability factors)
sit between the gradient and the write: g² statistics and `Σ u²` (optim-adafactor's kernels,
reused), then `_momentum_kernel` and `_apply_kernel` here. The O(n + m) work between passes runs
as torch ops shared with `_torch_path` and stays on the device. Sums are fp32 and deterministic
(row-block partials summed in a fixed order, no atomics).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch
from torch import Tensor

from optim_adafactor import factored
from optim_adafactor import quant as _quant
from optim_came._torch_path import Work, clip_scale

quant_seed = _quant.quant_seed  # the hash constant of a seed (`optim_adafactor.quant`)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None

BLOCK_N = factored.BLOCK_N  # rows per program: same row blocks as the statistics kernels
BLOCK_M = 64 if _INTERPRET else 256
NUM_WARPS = 8  # launch option of both kernels (stated, so tools/gpu_compile.py compiles it)


def launch_config(n_cols: int, *, quant: bool = False) -> tuple[int, int]:
    """(BLOCK_M, num_warps) for rows of `n_cols`.

    16 x 256 on 8 warps, or 16 x 64 on 4 warps when `n_cols % 16 != 0` (unaligned masks make
    every load scalar; fewer elements per thread keep the registers low, as optim-adafactor's
    `_kernels.launch_config`). `quant` (int8 `exp_avg`): tiles of whole quantization blocks,
    at least `_quant.QBLOCK` columns (also under the interpreter), on 8 warps (the unaligned
    16 x 128 tile spilled on 4 warps at sm_90).
    """
    bm, warps = (BLOCK_M, NUM_WARPS) if n_cols % 16 == 0 else (BLOCK_M // 4, 4)
    return (max(bm, _quant.QBLOCK), NUM_WARPS) if quant else (bm, warps)


def available(device: torch.device) -> bool:
    """Whether the kernels can run on `device` (CUDA, or CPU under the interpreter)."""
    return HAS_TRITON and factored.triton_available(device)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from optim_adafactor.quant import load_momentum, store_momentum

    _QB = tl.constexpr(_quant.QBLOCK)

    @triton.jit  # type: ignore[untyped-decorator]
    def _momentum_kernel(  # type: ignore[no-untyped-def]
        g_ptr,
        m_ptr,
        rs_ptr,
        cf_ptr,
        rowsum_ptr,
        colpart_ptr,
        beta1,
        n_rows,
        n_cols,
        n_row_blocks,
        BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        scale_ptr=None,
        qseed=0,
        QUANT: tl.constexpr = False,
        QSR: tl.constexpr = False,
    ):
        """`d = m - g·rs_i·cf_j`; `m ← m - (1-β1)·d`; row sums and partial column sums of d².

        `rs = rf · clip`; the instability is `β1² d²` (see `_torch_path.momentum`).
        One program owns BLOCK_N rows (row sums without atomics) and writes one row-block
        partial of the column sums; fp32 math, m stored back in its own dtype. QUANT: m is
        int8 codes with per-block scales (`optim_adafactor.quant`), decoded after the load
        and re-encoded (QSR: stochastically) before the store; BLOCK_M is a multiple of the block.
        """
        pid_b, pid_r, rows, row_mask, base = factored.row_tile(n_rows, n_cols, BLOCK_N)
        part = (pid_b * n_row_blocks + pid_r).to(tl.int64)
        # QUANT: each row's first scale (global row · blocks per row); -1 on masked rows
        srow = tl.where(row_mask, (pid_b.to(tl.int64) * n_rows + rows) * tl.cdiv(n_cols, _QB), -1)
        rs = tl.load(rs_ptr + pid_b.to(tl.int64) * n_rows + rows, mask=row_mask, other=0.0)
        acc_row = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_M):
            cols, col_mask, mask, offs = factored.col_tile(
                start, rows, row_mask, base, n_cols, BLOCK_M
            )
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # upcast first
            cf = tl.load(cf_ptr + pid_b.to(tl.int64) * n_cols + cols, mask=col_mask, other=0.0)
            m = load_momentum(m_ptr, scale_ptr, offs, mask, srow, start, tl.cdiv(n_cols, _QB),
                              QUANT, BLOCK_N, BLOCK_M)  # fmt: skip
            d = m - g * rs[:, None] * cf[None, :]
            m = m - (1.0 - beta1) * d
            store_momentum(m, m_ptr, scale_ptr, offs, mask, srow, start, tl.cdiv(n_cols, _QB),
                           qseed, QUANT, QSR, BLOCK_N, BLOCK_M)  # fmt: skip
            d2 = d * d  # masked lanes: g = m = 0, so d = 0
            acc_row += tl.sum(d2, axis=1)
            tl.store(colpart_ptr + part * n_cols + cols, tl.sum(d2, axis=0), mask=col_mask)
        tl.store(rowsum_ptr + pid_b.to(tl.int64) * n_rows + rows, acc_row, mask=row_mask)

    @triton.jit  # type: ignore[untyped-decorator]
    def _apply_kernel(  # type: ignore[no-untyped-def]
        p_ptr,
        m_ptr,
        rrs_ptr,
        cr_ptr,
        decay_ptr,
        seed,
        n_rows,
        n_cols,
        HAS_DECAY: tl.constexpr,
        SR: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        scale_ptr=None,
        QUANT: tl.constexpr = False,
    ):
        """`p ← p - wd_lr·p - m·rRs_i·cR_j` in fp32, stored in p's dtype (SR: stochastic, bf16).

        `rRs = lr · rsqrt(R / mean(R))`, `cR = rsqrt(C)`. `decay_ptr` holds
        `wd_lr = weight_decay · lr` (a device value: `lr` may be a tensor). The decay is
        came-pytorch's `p.add_(p, alpha=-wd·lr)`, not `p·(1 - wd_lr)`, whose fp32 rounding of
        `1 - wd_lr` biases it by up to 0.3% near wd·lr = 1e-5.
        """
        pid_b, _, rows, row_mask, base = factored.row_tile(n_rows, n_cols, BLOCK_N)
        # QUANT: each row's first scale; -1 on masked rows
        srow = tl.where(row_mask, (pid_b.to(tl.int64) * n_rows + rows) * tl.cdiv(n_cols, _QB), -1)
        rrs = tl.load(rrs_ptr + pid_b.to(tl.int64) * n_rows + rows, mask=row_mask, other=0.0)
        wd_lr = 0.0
        if HAS_DECAY:
            wd_lr = tl.load(decay_ptr)
        for start in range(0, n_cols, BLOCK_M):
            cols, col_mask, mask, offs = factored.col_tile(
                start, rows, row_mask, base, n_cols, BLOCK_M
            )
            cr = tl.load(cr_ptr + pid_b.to(tl.int64) * n_cols + cols, mask=col_mask, other=0.0)
            m = load_momentum(m_ptr, scale_ptr, offs, mask, srow, start, tl.cdiv(n_cols, _QB),
                              QUANT, BLOCK_N, BLOCK_M)  # fmt: skip
            p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            upd = m * rrs[:, None] * cr[None, :]
            ctr = factored.sr_counters(pid_b * n_rows + rows, start, n_cols, BLOCK_M)
            factored.store_update(p_ptr, offs, mask, p, upd, wd_lr, seed, ctr, HAS_DECAY, SR)

    def gpu_launch_configs() -> list[dict[str, Any]]:
        """Every launch the launchers below make on a GPU (for tools/gpu_compile.py).

        bf16/fp16/fp32 gradients and parameters, momentum fp32 or int8 (nearest and stochastic
        codes), every flag combination, and column counts that are and are not multiples of 16.
        """
        f32 = torch.float32
        launches: list[dict[str, Any]] = []
        args: dict[str, Any]
        for dtype in (torch.bfloat16, torch.float16, f32):
            for n_cols in (4096, 4095):
                dims = {"n_rows": 4096, "n_cols": n_cols, "BLOCK_N": BLOCK_N}
                for quant, qsr in ((False, False), (True, False), (True, True)):
                    qbm, warps = launch_config(n_cols, quant=quant)
                    opts = {"num_warps": warps}
                    m_dtype = torch.int8 if quant else f32
                    q = {"scale_ptr": f32 if quant else None, "BLOCK_M": qbm, "QUANT": quant}
                    args = {"g_ptr": dtype, "m_ptr": m_dtype, "rs_ptr": f32, "cf_ptr": f32,
                            "rowsum_ptr": f32, "colpart_ptr": f32, "beta1": 0.9,
                            "n_row_blocks": 256, "qseed": 123456789 if qsr else 0, **dims, **q,
                            "QSR": qsr}  # fmt: skip
                    launches.append({"kernel": _momentum_kernel, "args": args, "options": opts})
                    if qsr:
                        continue
                    for has_decay in (False, True):
                        for sr in (False, True) if dtype == torch.bfloat16 else (False,):
                            args = {"p_ptr": dtype, "m_ptr": m_dtype, "rrs_ptr": f32,
                                    "cr_ptr": f32, "decay_ptr": f32, "seed": 12345,
                                    "HAS_DECAY": has_decay, "SR": sr, **dims, **q}  # fmt: skip
                            launches.append({"kernel": _apply_kernel, "args": args,
                                             "options": opts})  # fmt: skip
        return launches


# ---------------------------------------------------------------------------------- references
def momentum_reference(
    g: Tensor, m: Tensor, rs: Tensor, cf: Tensor, beta1: float
) -> tuple[Tensor, Tensor]:
    """Reference of `_momentum_kernel` on (B, n, m), in place on `m`; returns d² row/col sums."""
    d = m.float() - g.float() * rs.unsqueeze(-1) * cf.unsqueeze(-2)
    m.copy_(m.float() - (1.0 - beta1) * d)
    d2 = d.square()
    return d2.sum(dim=-1), d2.sum(dim=-2)


def apply_reference(p: Tensor, m: Tensor, rrs: Tensor, cr: Tensor, wd_lr: float) -> None:
    """Reference of `_apply_kernel` (round-to-nearest store), in place on `p`."""
    p32 = p.float()
    p.copy_(p32 - wd_lr * p32 - m.float() * rrs.unsqueeze(-1) * cr.unsqueeze(-2))


# ---------------------------------------------------------------------------------- launchers
def _shape(w: Work) -> tuple[Tensor, int, int, int, int]:
    p, g = w.param, w.grad
    if p.dim() < 2 or not p.is_contiguous():
        raise ValueError(
            f"the fused kernels need a contiguous >=2-D parameter, got shape {tuple(p.shape)}"
        )
    if g.shape != p.shape or g.device != p.device:
        raise ValueError("gradient and parameter must have the same shape and device")
    g3 = factored.as_3d(g.contiguous())
    b, n, m = g3.shape
    return g3, b, n, m, -(-n // BLOCK_N)


def grad_stats(w: Work, buf: Tensor | None = None) -> None:
    """Phase 1 with the reused statistics kernel; same contract as `_torch_path.grad_stats`."""
    g3, _, n, m, _ = _shape(w)
    o, st = w.opts, w.state
    rowsum, colsum = factored.sq_stats(g3)
    lead = w.param.shape[:-2]
    row = st["exp_avg_sq_row"]
    factored.ema_(row, rowsum.view(*lead, n).div_(m), o.beta2, o.eps1)
    w.colsum = colsum.view(*lead, m)
    w.rowema_sum = row.sum(dim=-1)


def update_sumsq(w: Work, buf: Tensor | None = None, *, gsq_in_buf: bool = False) -> Tensor:
    """Phase 3 with the reused `scaled_sumsq` kernel: Σ u²."""
    g3, b, n, m, _ = _shape(w)
    assert w.rf is not None
    assert w.cf is not None
    return factored.scaled_sumsq(g3, w.rf.reshape(b, n), w.cf.reshape(b, m))


def momentum(w: Work, usq: Tensor, buf: Tensor | None = None, *, u_in_buf: bool = False) -> None:
    """Phase 4 with `_momentum_kernel`; same contract as `_torch_path.momentum`."""
    g3, b, n, m, blocks = _shape(w)
    o, st = w.opts, w.state
    assert w.rf is not None
    assert w.cf is not None
    w.clip = clip_scale(usq, w.numel, o.clip_threshold)
    f32: dict[str, Any] = {"dtype": torch.float32, "device": g3.device}
    rowsum = torch.zeros((b, n), **f32)
    colpart = torch.zeros((b, blocks, m), **f32)
    mom = st["exp_avg"]
    quant = mom.dtype == torch.int8
    nbytes = g3.dtype.itemsize + 2 * mom.dtype.itemsize + (8 / _quant.QBLOCK if quant else 0)
    if b * n * m > 0 and not factored.planned(_momentum_kernel, g3, nbytes):
        bm, warps = launch_config(m, quant=quant)
        _momentum_kernel[(b, blocks)](
            g3, mom, (w.rf * w.clip).reshape(b, n).contiguous(),
            w.cf.reshape(b, m).contiguous(), rowsum, colpart, o.beta1, n, m, blocks,
            BLOCK_N=BLOCK_N, BLOCK_M=bm, scale_ptr=st.get("exp_avg_scale"),
            qseed=quant_seed(w.quant_seed, _quant.shard_offset(w)), QUANT=quant,
            QSR=w.quant_seed is not None, num_warps=warps,
        )  # fmt: skip
    beta1_sq = o.beta1 * o.beta1
    lead = w.param.shape[:-2]
    res_row = st["exp_avg_res_row"]
    factored.ema_(res_row, rowsum.view(*lead, n).mul_(beta1_sq / m), o.beta3, o.eps2)
    w.res_colsum = colpart.sum(dim=1).view(*lead, m).mul_(beta1_sq)
    w.res_rowema_sum = res_row.sum(dim=-1)


def apply(w: Work, buf: Tensor | None = None, *, seed: int = 0) -> None:
    """Phase 6 with `_apply_kernel`: one pass over p and m."""
    _, b, n, m, blocks = _shape(w)
    o = w.opts
    assert w.res_rf is not None
    assert w.res_cf is not None
    p3 = factored.as_3d(w.param)
    mom = w.state["exp_avg"]
    quant = mom.dtype == torch.int8
    nbytes = mom.dtype.itemsize + 2 * p3.dtype.itemsize + (4 / _quant.QBLOCK if quant else 0)
    if b * n * m == 0 or factored.planned(_apply_kernel, p3, nbytes):
        return
    sr = o.stochastic_rounding and w.param.dtype == torch.bfloat16
    rrs = (w.res_rf * o.lr).reshape(b, n).contiguous()
    # weight_decay · lr on the device (a tensor `lr` is never read on the host)
    wd_lr = torch.empty(1, dtype=torch.float32, device=rrs.device).fill_(o.lr * o.weight_decay)
    bm, warps = launch_config(m, quant=quant)
    _apply_kernel[(b, blocks)](
        p3, mom, rrs, w.res_cf.reshape(b, m).contiguous(), wd_lr, seed, n, m,
        HAS_DECAY=o.weight_decay != 0, SR=sr, BLOCK_N=BLOCK_N, BLOCK_M=bm,
        scale_ptr=w.state.get("exp_avg_scale"), QUANT=quant, num_warps=warps,
    )  # fmt: skip
