# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""Fused Triton kernels for the factored (>=2-D) Adafactor step and their launchers.

A factored step on a (B, n, m) tensor takes three streaming passes, because the update's RMS
(the clip) is a global reduction that must finish before the parameter is written:
`_stats_kernel` (g² row sums, row-block column partials, Σ p²), `_sumsq_kernel` (Σ u²) and
`_apply_kernel`. The O(n + m) work between passes runs as torch ops shared with the PyTorch path
(`_torch_path.finish_stats`), on the device; the phases around the launches are `_triton_path`'s.
Each launcher is followed by its kernel's pure-PyTorch reference (`*_reference`) for the tests.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Any

import torch
from torch import Tensor

from optim_adafactor import _multi_tables
from optim_adafactor._quant_kernels import QBLOCK

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None

# Tiles: BLOCK_N rows x BLOCK_M columns; small under the interpreter, which is slow per program.
BLOCK_N = 16
BLOCK_M = 64 if _INTERPRET else 256
NUM_WARPS = 8  # launch option of every kernel here (stated, so tools/gpu_compile.py compiles it)


def launch_config(n_cols: int, *, quant: bool = False) -> tuple[int, int]:
    """(BLOCK_M, num_warps) of every kernel here for rows of `n_cols` (16 x BLOCK_M tiles).

    Aligned rows: 16 x 256 on 8 warps (16-byte vector loads). An odd `n_cols` makes every load
    a scalar load with its own address, and larger tiles then come close to spilling registers,
    so those rows take 16 x 64 on 4 warps (ptxas evidence in benchmarks/RESULTS.md). `quant`
    (the apply kernel with an int8 `exp_avg`): one whole 128-column block per row, 16 x 128 on
    8 warps for every width (also under the interpreter): at 16 x 256 the decode, encode and
    parameter store took 128-255 registers and spilled 8-272 bytes on sm_80/sm_90
    (tools/gpu_compile.py, triton 3.7.1).
    """
    if quant:
        return QBLOCK, NUM_WARPS
    if n_cols % 16 == 0:
        return BLOCK_M, NUM_WARPS
    return BLOCK_M // 4, 4


def available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on `device` (CUDA, or CPU under the interpreter)."""
    if not HAS_TRITON:
        return False
    if device.type == "meta":  # a launch plan: the steps record their launches
        return _multi_tables.planning()
    return device.type == "cuda" or (_INTERPRET and device.type == "cpu")


if HAS_TRITON:
    import triton
    import triton.language as tl

    from optim_adafactor._jit_helpers import (
        col_tile,
        momentum_store,
        row_tile,
        sr_counters,
        store_update,
    )
    from optim_adafactor._quant_kernels import load_momentum, store_momentum

    _QB = tl.constexpr(QBLOCK)

    @triton.jit  # type: ignore[untyped-decorator]
    def _stats_kernel(  # type: ignore[no-untyped-def]
        g_ptr,
        p_ptr,
        rowsum_ptr,
        colpart_ptr,
        ppart_ptr,
        n_rows,
        n_cols,
        n_row_blocks,
        HAS_P: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """Row sums and partial column sums of g², partial Σ p²; fp32 accumulation."""
        pid_b, pid_r, rows, row_mask, base = row_tile(n_rows, n_cols, BLOCK_N)
        part = (pid_b * n_row_blocks + pid_r).to(tl.int64)
        # row sums accumulate elementwise and are reduced once, after the loop (fixed order)
        acc_row = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_p = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_M):
            cols, col_mask, mask, offs = col_tile(start, rows, row_mask, base, n_cols, BLOCK_M)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # upcast first
            g2 = g * g
            acc_row += g2
            tl.store(colpart_ptr + part * n_cols + cols, tl.sum(g2, axis=0), mask=col_mask)
            if HAS_P:
                p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                acc_p += p * p
        row_sum = tl.sum(acc_row, axis=1)
        tl.store(rowsum_ptr + pid_b.to(tl.int64) * n_rows + rows, row_sum, mask=row_mask)
        if HAS_P:
            tl.store(ppart_ptr + part, tl.sum(tl.sum(acc_p, axis=1), axis=0))

    @triton.jit  # type: ignore[untyped-decorator]
    def _sumsq_kernel(  # type: ignore[no-untyped-def]
        g_ptr,
        rf_ptr,
        cf_ptr,
        upart_ptr,
        n_rows,
        n_cols,
        n_row_blocks,
        BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """Partial Σ u² per row block, u = g · rf_i · cf_j (fp32)."""
        pid_b, pid_r, rows, row_mask, base = row_tile(n_rows, n_cols, BLOCK_N)
        rf = tl.load(rf_ptr + pid_b.to(tl.int64) * n_rows + rows, mask=row_mask, other=0.0)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # reduced once, after the loop
        for start in range(0, n_cols, BLOCK_M):
            cols, col_mask, mask, offs = col_tile(start, rows, row_mask, base, n_cols, BLOCK_M)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            cf = tl.load(cf_ptr + pid_b.to(tl.int64) * n_cols + cols, mask=col_mask, other=0.0)
            u = g * rf[:, None] * cf[None, :]
            acc += u * u
        tl.store(upart_ptr + pid_b * n_row_blocks + pid_r, tl.sum(tl.sum(acc, axis=1), axis=0))

    @triton.jit  # type: ignore[untyped-decorator]
    def _apply_kernel(  # type: ignore[no-untyped-def]
        g_ptr,
        p_ptr,
        m_ptr,
        rs_ptr,
        cf_ptr,
        decay_ptr,
        beta1,
        seed,
        n_rows,
        n_cols,
        HAS_M: tl.constexpr,
        HAS_DECAY: tl.constexpr,
        SR: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        scale_ptr=None,
        qseed=0,
        QUANT: tl.constexpr = False,
        QSR: tl.constexpr = False,
    ):
        """`m = β1 m + g·rs_i·cf_j`; `p = p - wd_lr·p - (m or g·rs_i·cf_j)`; store in p's dtype.

        `rs = rf · lr_t / max(1, RMS(u)/d) (· (1-β1))` is computed on the device beforehand.
        The decay is `p - wd_lr·p` (HF's `p.add_(p, alpha=-wd·lr)`), not `p·(1 - wd_lr)`: the
        fp32 rounding of `1 - wd_lr` would bias it by up to 0.3% near wd·lr = 1e-5.

        With SR, the fp32 result gets uniform 16-bit noise added to its bit pattern and is
        truncated to bf16 (unbiased stochastic rounding); the noise of each 8 columns of a
        row comes from one Philox draw (`sr_counters`: counted over the batch's rows).

        QUANT (needs HAS_M): `m` is int8 codes with per-block scales (`optim_adafactor.quant`),
        decoded after the load and re-encoded (QSR: stochastically, `qseed` the hash constant)
        before the store, in the same pass; BLOCK_M is a multiple of 128. p steps by the fp32
        `m` before it is encoded.
        """
        pid_b, _, rows, row_mask, base = row_tile(n_rows, n_cols, BLOCK_N)
        # QUANT: each row's first scale (global row · blocks per row); -1 on masked rows
        n_blocks = tl.cdiv(n_cols, _QB)
        srow = tl.where(row_mask, (pid_b.to(tl.int64) * n_rows + rows) * n_blocks, -1)
        rs = tl.load(rs_ptr + pid_b.to(tl.int64) * n_rows + rows, mask=row_mask, other=0.0)
        wd_lr = 0.0
        if HAS_DECAY:
            wd_lr = tl.load(decay_ptr)
        for start in range(0, n_cols, BLOCK_M):
            cols, col_mask, mask, offs = col_tile(start, rows, row_mask, base, n_cols, BLOCK_M)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            cf = tl.load(cf_ptr + pid_b.to(tl.int64) * n_cols + cols, mask=col_mask, other=0.0)
            upd = g * rs[:, None] * cf[None, :]
            ctr = sr_counters(pid_b * n_rows + rows, start, n_cols, BLOCK_M)
            if QUANT:  # masked lanes: g = 0 and the codes load as 0, so m = 0 (absmax)
                m = load_momentum(m_ptr, scale_ptr, offs, mask, srow, start, n_blocks, True,
                                  BLOCK_N, BLOCK_M)  # fmt: skip
                m = beta1 * m + upd
                store_momentum(m, m_ptr, scale_ptr, offs, mask, srow, start, n_blocks, qseed,
                               True, QSR, BLOCK_N, BLOCK_M)  # fmt: skip
                p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                store_update(p_ptr, offs, mask, p, m, wd_lr, seed, ctr, HAS_DECAY, SR)
            else:
                momentum_store(p_ptr, m_ptr, offs, mask, upd, beta1, wd_lr, seed, ctr, HAS_M,
                               HAS_DECAY, SR)  # fmt: skip

    def gpu_launch_configs() -> list[dict[str, Any]]:
        """Every launch the launchers below make on a GPU (for tools/gpu_compile.py).

        Parameters/gradients in bf16, fp16 and fp32 (state fp32; the momentum fp32 or int8),
        every flag combination, and
        column counts that are and are not multiples of 16 (Triton specializes on that: an odd
        `n_cols` makes the masks unaligned and the loads scalar).
        """
        f32 = torch.float32
        launches: list[dict[str, Any]] = []
        for dtype in (torch.bfloat16, torch.float16, f32):
            for n_cols in (4096, 4095):
                bm, warps = launch_config(n_cols)
                opts = {"num_warps": warps}
                dims = {"n_rows": 4096, "n_cols": n_cols, "BLOCK_N": BLOCK_N, "BLOCK_M": bm}
                args: dict[str, Any]
                for has_p in (False, True):
                    args = {"g_ptr": dtype, "p_ptr": dtype, "rowsum_ptr": f32,
                            "colpart_ptr": f32, "ppart_ptr": f32, "n_row_blocks": 256,
                            "HAS_P": has_p, **dims}  # fmt: skip
                    launches.append({"kernel": _stats_kernel, "args": args, "options": opts})
                args = {"g_ptr": dtype, "rf_ptr": f32, "cf_ptr": f32, "upart_ptr": f32,
                        "n_row_blocks": 256, **dims}  # fmt: skip
                launches.append({"kernel": _sumsq_kernel, "args": args, "options": opts})
                # momentum: none, fp32, int8 with nearest and stochastic codes
                for has_m, quant, qsr in ((False,) * 3, (True, False, False), (True, True, False),
                                          (True, True, True)):  # fmt: skip
                    qbm, qwarps = launch_config(n_cols, quant=quant)
                    q = {"m_ptr": torch.int8 if quant else f32, "scale_ptr": f32 if quant else None,
                         "qseed": 123456789 if qsr else 0, "QUANT": quant, "QSR": qsr,
                         "BLOCK_M": qbm}  # fmt: skip
                    for has_decay in (False, True):
                        for sr in (False, True) if dtype == torch.bfloat16 else (False,):
                            args = {"g_ptr": dtype, "p_ptr": dtype, "rs_ptr": f32,
                                    "cf_ptr": f32, "decay_ptr": f32, "beta1": 0.9, "seed": 12345,
                                    "HAS_M": has_m, "HAS_DECAY": has_decay, "SR": sr,
                                    **dims, **q}  # fmt: skip
                            launches.append({"kernel": _apply_kernel, "args": args,
                                             "options": {"num_warps": qwarps}})  # fmt: skip
        return launches


# ---------------------------------------------------------------------------------- launchers
def planned(kernel: Any, g3: Tensor, bytes_per_element: float) -> bool:
    """While planning (`_multi_tables.plan_launches`): record a (B, blocks) launch over `g3`."""
    if not _multi_tables.planning():
        return False
    b, n, m = g3.shape
    sizes = [min(BLOCK_N, n - r0) * m for _ in range(b) for r0 in range(0, n, BLOCK_N)]
    work = _multi_tables.Work.of(sizes)
    return _multi_tables.planned(kernel, work, work.total * bytes_per_element)


def as_3d(t: Tensor) -> Tensor:
    """View (..., n, m) as (B, n, m)."""
    return t.reshape(math.prod(t.shape[:-2]), t.shape[-2], t.shape[-1])


_as_3d = as_3d


def launch_stats(g3: Tensor, p3: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Launch `_stats_kernel` on contiguous (B, n, m) tensors.

    Returns the row sums (B, n) and row-block partial column sums (B, blocks, m) of g², and (if
    `p3` is given) the partial Σ p² (B·blocks,).
    """
    b, n, m = g3.shape
    blocks = -(-n // BLOCK_N)
    bm, warps = launch_config(m)
    f32: dict[str, Any] = {"dtype": torch.float32, "device": g3.device}
    rowsum = torch.empty((b, n), **f32)
    colpart = torch.empty((b, blocks, m), **f32)
    ppart = torch.empty((b * blocks,), **f32) if p3 is not None else None
    gb = g3.dtype.itemsize + (p3.dtype.itemsize if p3 is not None else 0)
    if b * n * m > 0 and not planned(_stats_kernel, g3, gb + 4 / BLOCK_N):
        _stats_kernel[(b, blocks)](
            g3, p3 if p3 is not None else g3, rowsum, colpart,
            ppart if ppart is not None else rowsum, n, m, blocks,
            HAS_P=p3 is not None, BLOCK_N=BLOCK_N, BLOCK_M=bm, num_warps=warps,
        )  # fmt: skip
    else:
        rowsum.zero_()
        colpart.zero_()
        if ppart is not None:
            ppart.zero_()
    return rowsum, colpart, ppart


def stats_reference(g: Tensor, p: Tensor | None, block_n: int = BLOCK_N) -> tuple[Tensor, ...]:
    """Reference of `_stats_kernel` on (B, n, m): row sums, (B, blocks, m) partials, Σp² parts."""
    g2 = g.float().square()
    b, n, m = g2.shape
    blocks = -(-n // block_n)
    pad = blocks * block_n - n
    padded = torch.nn.functional.pad(g2, (0, 0, 0, pad))
    colpart = padded.view(b, blocks, block_n, m).sum(dim=2)
    ppart = None
    if p is not None:
        p2 = torch.nn.functional.pad(p.float().square(), (0, 0, 0, pad))
        ppart = p2.view(b, blocks, block_n * m).sum(dim=-1).reshape(-1)
    return g2.sum(dim=-1), colpart, *((ppart,) if ppart is not None else ())


def launch_sumsq(g3: Tensor, rf: Tensor, cf: Tensor) -> Tensor:
    """`_sumsq_kernel`: Σ (g · rf ⊗ cf)² for contiguous (B, n, m) `g3`, (B, n) `rf`, (B, m) `cf`."""
    b, n, m = g3.shape
    blocks = -(-n // BLOCK_N)
    bm, warps = launch_config(m)
    upart = torch.zeros((b * blocks,), dtype=torch.float32, device=g3.device)
    if b * n * m > 0 and not planned(_sumsq_kernel, g3, g3.dtype.itemsize):
        _sumsq_kernel[(b, blocks)](
            g3, rf.reshape(b, n).contiguous(), cf.reshape(b, m).contiguous(), upart,
            n, m, blocks, BLOCK_N=BLOCK_N, BLOCK_M=bm, num_warps=warps,
        )  # fmt: skip
    return upart.sum()


def sumsq_reference(g: Tensor, rf: Tensor, cf: Tensor) -> Tensor:
    """Reference of `_sumsq_kernel`, summed: Σ (g · rf ⊗ cf)²."""
    return (g.float() * rf.unsqueeze(-1) * cf.unsqueeze(-2)).square().sum()


def launch_apply(
    g3: Tensor,
    p3: Tensor,
    exp_avg: Tensor | None,
    rs: Tensor,
    cf: Tensor,
    decay: Tensor | None,
    beta1: float | None,
    seed: int,
    *,
    sr: bool,
    scale: Tensor | None = None,
    qseed: int | None = None,
) -> None:
    """`_apply_kernel` on contiguous (B, n, m) `g3`, `p3` (and the momentum `exp_avg`).

    `rs` (B, n) row scales and `cf` (B, m) column factors in fp32; `decay` a 1-element fp32
    `weight_decay · lr_t` or None; `sr` rounds bf16 parameters stochastically with `seed`.
    An int8 `exp_avg` (codes) comes with its fp32 block `scale`s and, for stochastic codes,
    `qseed` (`quant.quant_seed`).
    """
    b, n, m = g3.shape
    quant = exp_avg is not None and exp_avg.dtype == torch.int8
    m_bytes = 0.0 if exp_avg is None else 2 * exp_avg.dtype.itemsize + (8 / QBLOCK if quant else 0)
    nbytes = g3.dtype.itemsize + 2 * p3.dtype.itemsize + m_bytes
    if b * n * m == 0 or planned(_apply_kernel, g3, nbytes):
        return
    bm, warps = launch_config(m, quant=quant)
    rs = rs.reshape(b, n).contiguous()
    _apply_kernel[(b, -(-n // BLOCK_N))](
        g3, p3, exp_avg if exp_avg is not None else g3, rs, cf.reshape(b, m).contiguous(),
        decay if decay is not None else rs,
        0.0 if beta1 is None else beta1, seed, n, m,
        HAS_M=exp_avg is not None, HAS_DECAY=decay is not None, SR=sr,
        BLOCK_N=BLOCK_N, BLOCK_M=bm, scale_ptr=scale, qseed=qseed or 0, QUANT=quant,
        QSR=quant and qseed is not None, num_warps=warps,
    )  # fmt: skip


def apply_reference(
    g: Tensor,
    p: Tensor,
    m: Tensor | None,
    rs: Tensor,
    cf: Tensor,
    decay: Tensor | None,
    beta1: float,
) -> None:
    """Reference of `_apply_kernel` (round-to-nearest store), in place on `p` and `m`.

    `decay` holds `weight_decay · lr_t` (shape (1,)) or is None.
    """
    upd = g.float() * rs.unsqueeze(-1) * cf.unsqueeze(-2)
    if m is not None:
        m.mul_(beta1).add_(upd)
        upd = m
    p32 = p.float()
    if decay is not None:
        p32 = p32 - decay * p32
    p.copy_(p32 - upd)
