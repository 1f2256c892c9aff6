"""The PyTorch path of one Adafactor step (the CPU path and the kernels' reference), in phases.

A step on one parameter is four phases, `local_stats`, `finish_stats`, `update_sumsq` and
`apply`; between them a row-sharded parameter all-reduces its partial sums (see `sharding.py`),
which is why the step is split. Every temporary lives in a reusable workspace (`buf`; one chunk
of rows on the CPU, `factored.chunk_shape`), because on CPU fresh page-faulted allocations cost as
much as the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from optim_adafactor import quant
from optim_adafactor.base import StepWork, decay_
from optim_adafactor.checks import Scalar
from optim_adafactor.factored import (
    add_scaled_,
    chunk,
    ema_,
    factored_sumsq,
    factors,
    gsq_stats,
    row_chunks,
)


@dataclass(slots=True, kw_only=True)
class Work(StepWork):
    """One parameter's Adafactor step in flight (see `StepWork` for the shared fields)."""

    eps1: float
    psq: Tensor | None = None
    lr_t: Scalar = 0.0
    norm: Tensor | None = None  # torch semantics: clamp(mean(R), ε1)
    usq: Tensor | None = None  # Σ u², reduced over the shard group (sharded steps)


def local_stats(w: Work, buf: Tensor) -> None:
    """Phase 1: `Σ p²` (for RMS(p)), row EMA `r` of `mean_j(g² + ε1)`, column sums of g², `Σ_i r_i`.

    Vectors update their full second moment instead. Leaves `g²` in `buf` for factored tensors.
    """
    o, g, st = w.opts, w.grad, w.state
    if o.needs_param_rms:
        w.psq = torch.linalg.vector_norm(w.p32).square()
    beta2 = o.beta2(w.step)
    if w.factored:
        row = st["exp_avg_sq_row"]
        if o.semantics == "torch":  # one sweep, as `_foreach_path` (bit-equal) sums
            torch.mul(g, g, out=buf)
            row.lerp_(buf.sum(dim=-1).div_(g.shape[-1]), 1.0 - beta2)
            w.colsum = buf.sum(dim=-2)
        else:
            w.colsum, w.gsq_over_row = gsq_stats(g, buf, row, beta2, w.eps1)
        w.rowema_sum = row.sum(dim=-1)
    else:
        torch.mul(g, g, out=buf)
        var = st["exp_avg_sq"]
        if o.semantics == "torch":
            var.lerp_(buf, 1.0 - beta2)
        else:
            ema_(var, buf, beta2, w.eps1)


def finish_stats(w: Work) -> None:
    """Phase 2: column EMA `c`, the factors and the step size `lr_t`, from (reduced) phase-1 sums.

    Factors `rf = rsqrt(r / mean(r))`, `cf = rsqrt(c)` (torch semantics: the normaliser
    `max(mean(r), ε1)` instead); `lr_t` is a 0-dim device tensor when it depends on RMS(p).
    """
    o, st = w.opts, w.state
    rel = o.relative_step_size(w.step)
    if isinstance(rel, Tensor):  # a float64 lr tensor rounds to fp32 first, as a float lr does
        rel = rel.to(w.p32.dtype)
    if o.needs_param_rms:
        assert w.psq is not None
        rms = w.psq.div(w.numel).sqrt_()
        w.lr_t = rms.clamp_(min=o.eps2).mul_(rel)
    else:
        w.lr_t = rel
    if not w.factored:
        return
    assert w.colsum is not None
    assert w.rowema_sum is not None
    beta2 = o.beta2(w.step)
    row, col = st["exp_avg_sq_row"], st["exp_avg_sq_col"]
    col_in = w.colsum.div_(w.rows)
    row_mean = w.rowema_sum.div(w.rows).unsqueeze(-1)
    if o.semantics == "torch":
        col.lerp_(col_in, 1.0 - beta2)
        w.norm = row_mean.clamp_(min=w.eps1)
    else:
        ema_(col, col_in, beta2, w.eps1)
        w.rf, w.cf = factors(row, col, row_mean)


def _materialise_update(w: Work, buf: Tensor) -> Tensor:
    """`u` (before clipping and scaling) into `buf`; used by vectors and torch semantics."""
    st, g = w.state, w.grad
    if not w.factored:
        var = st["exp_avg_sq"]
        if w.opts.semantics == "torch":
            torch.clamp(var, min=w.eps1 * w.eps1, out=buf).rsqrt_()
        else:
            torch.rsqrt(var, out=buf)
        return buf.mul_(g)
    if w.opts.semantics == "torch":
        # torch.optim.Adafactor: V = (R ⊗ C) / max(mean(R), ε1), clamped at ε1², u = g / √V.
        assert w.norm is not None
        row, col = st["exp_avg_sq_row"], st["exp_avg_sq_col"]
        torch.mul(row.unsqueeze(-1), col.unsqueeze(-2), out=buf)
        buf.div_(w.norm.unsqueeze(-1)).clamp_(min=w.eps1 * w.eps1).rsqrt_()
        return buf.mul_(g)
    assert w.rf is not None
    assert w.cf is not None
    torch.mul(g, w.rf.unsqueeze(-1), out=buf)
    return buf.mul_(w.cf.unsqueeze(-2))


def update_sumsq(w: Work, buf: Tensor, *, gsq_in_buf: bool) -> Tensor:
    """Phase 3: local `Σ u²`, `u = g·rf⊗cf` (`gsq_in_buf` is the kernels').

    Factored: from phase 1's column sums of `g² / r` (`factored_sumsq`), `u` never materialised.
    """
    if w.factored and w.opts.semantics != "torch":
        assert w.gsq_over_row is not None
        assert w.rowema_sum is not None
        assert w.cf is not None
        return factored_sumsq(w.gsq_over_row, w.cf, w.rowema_sum.div(w.rows).unsqueeze(-1))
    u = _materialise_update(w, buf)
    return torch.linalg.vector_norm(u).square()  # type: ignore[no-any-return]


def step_scale(w: Work, usq: Tensor | None) -> Scalar:
    """`lr_t / max(1, RMS(u) / clip_threshold)`, negated to maximize; `usq` None: no clip."""
    o = w.opts
    scale: Scalar = w.lr_t
    if usq is not None:
        assert o.clip_threshold is not None
        denom = usq.div(w.numel).sqrt_().div_(o.clip_threshold).clamp_(min=1.0)
        scale = denom.reciprocal_().mul_(scale)
    if o.maximize:
        scale = -scale
    return scale


def apply(w: Work, usq: Tensor | None, buf: Tensor, *, u_in_buf: bool) -> None:
    """Phase 4: clip, momentum, weight decay, parameter update (into `w.p32`).

    `usq` is the (reduced) `Σ u²`, or None when clipping is off. `u_in_buf`: `buf` holds the
    unscaled update from phase 3 (vectors and torch semantics only).
    """
    o, p, g, st = w.opts, w.p32, w.grad, w.state
    scale = step_scale(w, usq)
    if o.semantics == "torch":
        if o.weight_decay != 0:  # torch.optim.Adafactor: p *= 1 - lr·wd (its own form)
            assert o.lr is not None
            if isinstance(o.lr, Tensor):
                p.mul_(o.lr.mul(-o.weight_decay).add_(1.0).to(p.dtype))  # as a float: rounded
            else:
                p.mul_(1.0 - o.lr * o.weight_decay)
        u = buf if u_in_buf else _materialise_update(w, buf)
        add_scaled_(p, u, -scale)
        return
    beta1 = o.beta1
    if w.factored:
        assert w.rf is not None
        assert w.cf is not None
        row_scale = w.rf * (scale * (1.0 - beta1) if beta1 is not None else scale)
        for rows in row_chunks(w.p32):  # the whole phase on one chunk of rows at a time
            b, p = chunk(buf, rows), w.p32[rows]
            if o.weight_decay != 0:
                decay_(p, o.weight_decay, w.lr_t)  # HF: p -= wd·lr_t·p (lr_t incl. param scale)
            if beta1 is None:
                torch.mul(g[rows], row_scale[rows].unsqueeze(-1), out=b)
                p.addcmul_(b, w.cf.unsqueeze(-2), value=-1.0)
                continue
            m = quant.load_state(w, b, rows)  # int8: the codes dequantized into `w.m_buf`
            torch.mul(g[rows], row_scale[rows].unsqueeze(-1), out=b)
            m.mul_(beta1).addcmul_(b, w.cf.unsqueeze(-2))
            p.sub_(m)  # the fp32 momentum steps p, as in the fused kernels
            quant.store_state(w, m, b, rows)  # int8: codes of m; m and b are scratch now
        return
    if o.weight_decay != 0:
        decay_(p, o.weight_decay, w.lr_t)  # HF: p -= wd·lr_t·p (lr_t incl. param scale)
    u = buf if u_in_buf else _materialise_update(w, buf)
    if beta1 is None:
        add_scaled_(p, u, -scale)
    else:
        m = st["exp_avg"]
        add_scaled_(m.mul_(beta1), u, scale * (1.0 - beta1))
        p.sub_(m)
