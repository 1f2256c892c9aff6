"""The PyTorch path of one CAME step (the CPU path and the kernels' reference), in phases.

A factored parameter (>= 2 dims, viewed as (..., n, m)) steps in six phases, `grad_stats` to
`apply`; between phases 1-2, 3-4 and 4-5 a row-sharded parameter all-reduces its partial sums
(bucketed, see `optimizer.py`), which is why the step is split. Vectors and scalars keep a full
`v` and step `p ← p - lr·wd·p - lr·m` (no confidence term, as in came-pytorch). Every
temporary lives in reusable workspaces (`buf`, `Work.m_buf` for an int8 `exp_avg`), one chunk of
rows each on the CPU (`factored.chunk_shape`), so a step allocates nothing N-sized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from optim_adafactor import factored
from optim_adafactor.base import StepWork, decay_
from optim_adafactor.factored import add_scaled_, ema_, factored_sumsq, factors
from optim_adafactor.quant import load_state as load_momentum
from optim_adafactor.quant import store_state as store_momentum


@dataclass(slots=True, kw_only=True)
class Work(StepWork):
    """One parameter's CAME step in flight (see `StepWork` for the shared fields)."""

    clip: Tensor | None = None  # 1 / max(1, RMS(u)/d), 0-dim device tensor
    res_colsum: Tensor | None = None
    res_rowema_sum: Tensor | None = None
    res_rf: Tensor | None = None
    res_cf: Tensor | None = None


def grad_stats(w: Work, buf: Tensor) -> None:
    """Phase 1: row EMA `r = β2 r + (1-β2)(mean_j g² + ε1)`, local column sums of g², `Σ_i r_i`.

    Vectors update their full `v` instead. Leaves `g²` in `buf`.
    """
    o, g, st = w.opts, w.grad, w.state
    if not w.factored:
        ema_(st["exp_avg_sq"], torch.mul(g, g, out=buf), o.beta2, o.eps1)
        return
    row = st["exp_avg_sq_row"]
    w.colsum, w.gsq_over_row = factored.gsq_stats(g, buf, row, o.beta2, o.eps1)
    w.rowema_sum = row.sum(dim=-1)


def grad_factors(w: Work) -> None:
    """Phase 2: column EMA `c`, factors `rf = rsqrt(r / mean(r))`, `cf = rsqrt(c)`.

    From the (reduced) sums of phase 1; `cf` times `sqrt(1-β2^t)` with bias correction.
    """
    if w.factored:
        o = w.opts
        correction = o.second_moment_correction(w.step)
        w.rf, w.cf = _col_ema_factors(
            w, "exp_avg_sq", w.colsum, w.rowema_sum, beta=o.beta2, eps=o.eps1, correction=correction
        )


def _col_ema_factors(
    w: Work, key: str, colsum: Tensor | None, rowema_sum: Tensor | None, *, beta: float, eps: float,
    correction: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Column EMA of `key`'s factored state from `colsum`, then its row and column factors.

    `rf = rsqrt(r / mean(r))`, `cf = rsqrt(c)` times `sqrt(correction)` where that is not 1
    (bias correction `1-β^t`: `rsqrt(c / (1-β^t))`; r's cancels in `r / mean(r)`).
    """
    assert colsum is not None
    assert rowema_sum is not None
    row, col = w.state[f"{key}_row"], w.state[f"{key}_col"]
    ema_(col, colsum.div_(w.rows), beta, eps)
    rf, cf = factors(row, col, rowema_sum.div(w.rows).unsqueeze(-1))
    if correction != 1.0:
        cf.mul_(math.sqrt(correction))
    return rf, cf


def _vector_update(w: Work, buf: Tensor) -> Tensor:
    """`u = g / sqrt(v / (1-β2^t))` into `buf` (vectors and scalars)."""
    torch.rsqrt(w.state["exp_avg_sq"], out=buf)
    correction = w.opts.second_moment_correction(w.step)
    if correction != 1.0:
        buf.mul_(math.sqrt(correction))
    return buf.mul_(w.grad)


def update_sumsq(w: Work, buf: Tensor, *, gsq_in_buf: bool) -> Tensor:
    """Phase 3: local `Σ u²`, `u = g · rf ⊗ cf`, from phase 1's column sums of `g² / r`.

    `u` is never materialised. Vectors leave `u` in `buf` (`gsq_in_buf` is the kernels').
    """
    if not w.factored:
        return torch.linalg.vector_norm(_vector_update(w, buf)).square()  # type: ignore[no-any-return]
    assert w.gsq_over_row is not None
    assert w.rowema_sum is not None
    assert w.cf is not None
    return factored_sumsq(w.gsq_over_row, w.cf, w.rowema_sum.div(w.rows).unsqueeze(-1))


def clip_scale(usq: Tensor, numel: int, clip_threshold: float) -> Tensor:
    """`1 / max(1, RMS(u) / d)` as a 0-dim device tensor (no host sync)."""
    return usq.div(numel).sqrt_().div_(clip_threshold).clamp_(min=1.0).reciprocal_()


def momentum(w: Work, usq: Tensor, buf: Tensor, *, u_in_buf: bool) -> None:
    """Phase 4: clip, momentum, local instability statistics (factored tensors).

    `û = u / max(1, RMS(u)/d)`, `m = β1 m + (1-β1) û`, then the row EMA `R` and local column
    sums of the instability `(û - m)²`. Since `û - m_new = β1 (û - m_old)`, the workspace holds
    `m_old - û` once and serves both updates.

    `usq` is the (reduced) `Σ u²`; `u_in_buf`: a vector's `u` is still in `buf` from phase 3.
    """
    o, g, st = w.opts, w.grad, w.state
    w.clip = clip_scale(usq, w.numel, o.clip_threshold)
    if not w.factored:
        m = load_momentum(w)  # buf may hold u
        u = buf if u_in_buf else _vector_update(w, buf)
        m.mul_(o.beta1).addcmul_(u, w.clip * (1.0 - o.beta1))
        store_momentum(w, m)  # bf16: rounded once, as the kernels store it
        return
    assert w.rf is not None
    assert w.cf is not None
    chunks = factored.row_chunks(g)  # the phase runs on one chunk of rows after the other
    rowsum = g.new_empty(g.shape[:-1]) if len(chunks) > 1 else None
    colsum = None
    for rows in chunks:
        b = factored.chunk(buf, rows)
        m = load_momentum(w, b, rows)
        # b = m_old - û, with û = g · (rf · clip) ⊗ cf
        torch.mul(g[rows], (w.rf[rows] * w.clip).unsqueeze(-1), out=b)
        torch.addcmul(m, b, w.cf.unsqueeze(-2), value=-1.0, out=b)
        add_scaled_(m, b, -(1.0 - o.beta1))  # m_new = m_old - (1-β1)(m_old - û)
        # instability (û - m_new)² = β1² (m_old - û)²; its ε2 is added to the means by `ema_`
        b.square_()
        if rowsum is None:
            rowsum = b.sum(dim=-1)
        else:
            torch.sum(b, dim=-1, out=rowsum[rows])
        colsum = b.sum(dim=-2) if colsum is None else colsum.add_(b.sum(dim=-2))
        store_momentum(w, m, b, rows)  # int8: codes of m_new; m and b are scratch now
    assert rowsum is not None
    assert colsum is not None
    beta1_sq = o.beta1 * o.beta1
    res_row = st["exp_avg_res_row"]
    ema_(res_row, rowsum.mul_(beta1_sq / g.shape[-1]), o.beta3, o.eps2)
    w.res_colsum = colsum.mul_(beta1_sq)
    w.res_rowema_sum = res_row.sum(dim=-1)


def instability_factors(w: Work) -> None:
    """Phase 5: column EMA `C` of the instability and the factors of `R` and `C`.

    `res_rf = rsqrt(R / mean(R))`, `res_cf = rsqrt(C)`, from the (reduced) sums of phase 4;
    `res_cf` times `sqrt(1-β3^t)` with bias correction.
    """
    if w.factored:
        o = w.opts
        correction = o.instability_correction(w.step)
        w.res_rf, w.res_cf = _col_ema_factors(
            w, "exp_avg_res", w.res_colsum, w.res_rowema_sum, beta=o.beta3, eps=o.eps2,
            correction=correction,
        )  # fmt: skip


def apply(w: Work, buf: Tensor) -> None:
    """Phase 6: `p ← p - lr·wd·p - lr · m · res_rf ⊗ res_cf` (into `w.p32`)."""
    o = w.opts
    if not w.factored:
        if o.weight_decay != 0:
            decay_(w.p32, o.weight_decay, o.lr)  # came-pytorch: p.add_(p, alpha=-wd·lr)
        add_scaled_(w.p32, load_momentum(w), -o.lr)
        return
    assert w.res_rf is not None
    assert w.res_cf is not None
    for rows in factored.row_chunks(w.p32):
        b, p = factored.chunk(buf, rows), w.p32[rows]
        m = load_momentum(w, b, rows)  # int8: the stored (quantized) m steps p
        if o.weight_decay != 0:
            decay_(p, o.weight_decay, o.lr)
        torch.mul(m, (w.res_rf[rows] * o.lr).unsqueeze(-1), out=b)
        p.addcmul_(b, w.res_cf.unsqueeze(-2), value=-1.0)
