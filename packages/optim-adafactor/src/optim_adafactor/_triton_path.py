"""The fused (Triton) path of one Adafactor step, phase by phase: `_torch_path`'s contract.

Each phase checks the tensors, launches a kernel of `_kernels` (stats, sumsq, apply) and does
the small O(n + m) work around it with torch ops on vectors, on the device (no host sync).
"""

from __future__ import annotations

import torch
from torch import Tensor

from optim_adafactor import _kernels, quant
from optim_adafactor._kernels import as_3d, available
from optim_adafactor._torch_path import Work, step_scale
from optim_adafactor.factored import ema_

__all__ = ["apply", "available", "local_stats", "update_sumsq"]


def _check(w: Work) -> tuple[Tensor, Tensor]:
    """`(p3, g3)`: the parameter and its (contiguous) gradient viewed as (B, n, m)."""
    p, g = w.param, w.grad
    if p.dim() < 2:
        raise ValueError(f"the fused kernels handle >=2-D tensors, got shape {tuple(p.shape)}")
    if not p.is_contiguous():
        raise ValueError("the fused kernels need a contiguous parameter")
    if g.shape != p.shape or g.device != p.device:
        raise ValueError("gradient and parameter must have the same shape and device")
    return as_3d(p), as_3d(g.contiguous())


def local_stats(w: Work, buf: Tensor | None = None) -> None:
    """Phase 1 with `_stats_kernel`; same contract as `_torch_path.local_stats`."""
    p3, g3 = _check(w)
    n, m = g3.shape[1:]
    o, st = w.opts, w.state
    rowsum, colpart, ppart = _kernels.launch_stats(g3, p3 if o.needs_param_rms else None)
    if ppart is not None:
        w.psq = ppart.sum()
    beta2 = o.beta2(w.step)
    lead = w.param.shape[:-2]
    row = st["exp_avg_sq_row"]
    ema_(row, rowsum.view(*lead, n).div_(m), beta2, w.eps1)
    w.colsum = colpart.sum(dim=1).view(*lead, m)
    w.rowema_sum = row.sum(dim=-1)


def update_sumsq(w: Work, buf: Tensor | None = None, *, gsq_in_buf: bool = False) -> Tensor:
    """Phase 3 with `_sumsq_kernel`: Σ u² (the clip statistic)."""
    g3 = _check(w)[1]
    assert w.rf is not None
    assert w.cf is not None
    return _kernels.launch_sumsq(g3, w.rf, w.cf)


def apply(
    w: Work, usq: Tensor | None, buf: Tensor | None = None, *, u_in_buf: bool = False, seed: int = 0
) -> None:
    """Phase 4 with `_apply_kernel`: clip scale on the device, then one fused pass."""
    p3, g3 = _check(w)
    o = w.opts
    assert w.rf is not None
    assert w.cf is not None
    scale = step_scale(w, usq)
    beta1 = o.beta1
    rs = w.rf * (scale * (1.0 - beta1) if beta1 is not None else scale)
    decay = None  # weight_decay · lr_t, on the device
    if o.weight_decay != 0:
        wd_lr = w.lr_t * o.weight_decay  # a 0-dim device tensor with parameter scaling
        decay = torch.empty(1, dtype=torch.float32, device=g3.device).fill_(wd_lr)
    m_state = w.state.get("exp_avg") if beta1 is not None else None
    sr = o.stochastic_rounding and w.param.dtype == torch.bfloat16
    qseed = None if w.quant_seed is None else quant.quant_seed(w.quant_seed, quant.shard_offset(w))
    _kernels.launch_apply(g3, p3, m_state, rs, w.cf, decay, beta1, seed, sr=sr,
                          scale=w.state.get("exp_avg_scale"), qseed=qseed)  # fmt: skip
