"""The multi-tensor PyTorch step of torch semantics (`torch.optim.Adafactor`'s algorithm).

`step` runs `_torch_path`'s four phases of an unsharded parameter over a batch of them at once,
with the same operations in the same order (so on the CPU every result is bit for bit the
per-tensor path's): element-wise ops as `torch._foreach_*` over the batch, the per-tensor
scalars (RMS(p), Σu², the step sizes) as `torch._foreach_*` over lists of 0-dim tensors. On
CUDA a list op is a few launches where its tensors allow (same shape at each index); one op per
tensor stay the reductions over a dimension (row and column sums of g², the row-EMA sum),
the broadcast ones (`r ⊗ c / max(mean(r), ε1)`) and `p += -scale·u` with a 0-dim `scale`.
Unlike torch's `_multi_tensor_adafactor` nothing reads a value back to the host: the step sizes
stay on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from optim_adafactor._torch_path import Work
from optim_adafactor.checks import Scalar
from optim_adafactor.factored import compile_safe_scalars

_T = TypeVar("_T")

#: Whether CPU tensors take this path. No: on the CPU a list op is a loop over the tensors anyway,
#: and the per-tensor path, whose ops on one tensor stay in cache and reuse one workspace, was
#: faster (bench_adafactor.py, CPU, 1 thread, loaded: 154 ms per step against 188 ms). Tests set it.
ON_CPU = False


def wanted(w: Work) -> bool:
    """Whether `w` (torch semantics, unsharded, not fused) takes this path (see `ON_CPU`)."""
    return ON_CPU or w.grad.device.type != "cpu"


def batch_key(w: Work) -> tuple[object, ...]:
    """The works that `step` takes together: the same options, device, dtype (eagerly: step).

    Inside `torch.compile` the step count, a symbolic int, is left out: hashed, it was burnt into
    the graph (one recompile per step); compared between works (`==`), torch 2.13's inductor
    returned the new step counts through a symbol it never bound (`NameError: name 's37' is not
    defined`). The compiled `step` takes each work's own step count instead.
    """
    if compile_safe_scalars():
        return (id(w.opts), w.grad.device, w.grad.dtype, w.eps1)
    return (id(w.opts), w.step, w.grad.device, w.grad.dtype, w.eps1)


def step(works: list[Work]) -> tuple[list[Work], list[Tensor]]:
    """One step of `works` (all of one `batch_key`, torch semantics, unsharded, not fused).

    Updates `w.p32` and the state of every work; the caller writes bf16/fp16 parameters back.
    Returns the works (reordered: factored first) and each one's step size
    `lr_t = max(ε2, RMS(p)) · min(lr, 1/√t)`, a 0-dim tensor.

    Inside `torch.compile` the step-varying floats (`1 - β2_t` and `min(lr, 1/√t)` of each
    work's own step count, a float `lr` in the weight decay) scale one tensor at a time, as in
    the per-tensor path: as the scalar of a `torch._foreach_*` op a scheduled `lr`, which dynamo
    makes a symbolic float, was burnt into the graph (one recompile per step).
    """
    o, eps1 = works[0].opts, works[0].eps1
    assert o.clip_threshold is not None
    mats = [w for w in works if w.factored]
    works = mats + [w for w in works if not w.factored]  # the order of `updates`
    weights = _per_work(works, lambda t: 1.0 - o.beta2(t))
    params = [w.p32 for w in works]
    numels = [w.numel for w in works]
    # phases 1-2, scalars: lr_t = clamp(sqrt(Σp² / N), ε2) · rho_t (before the weight decay)
    lr_ts = list(torch._foreach_norm(params))
    torch._foreach_mul_(lr_ts, lr_ts)
    torch._foreach_div_(lr_ts, numels)
    torch._foreach_sqrt_(lr_ts)
    torch._foreach_clamp_min_(lr_ts, o.eps2)

    def rho(t: int) -> Scalar:  # a float64 lr tensor rounds to fp32 first, as a float lr does
        rel = o.relative_step_size(t)
        return rel.to(lr_ts[0].dtype) if isinstance(rel, Tensor) else rel

    _mul_(lr_ts, _per_work(works, rho))
    updates = _matrix_updates(mats, weights[: len(mats)], eps1) + _vector_updates(
        works[len(mats) :], weights[len(mats) :], eps1
    )
    # phase 3: 1 / max(1, RMS(u) / d) · lr_t, negated to descend
    scales = torch._foreach_norm(updates)
    torch._foreach_mul_(scales, scales)
    torch._foreach_div_(scales, numels)
    torch._foreach_sqrt_(scales)
    torch._foreach_div_(scales, o.clip_threshold)
    torch._foreach_clamp_min_(scales, 1.0)
    torch._foreach_reciprocal_(scales)
    torch._foreach_mul_(scales, lr_ts)
    if not o.maximize:  # `_torch_path.apply` adds -scale·u, scale negated once to maximize
        torch._foreach_neg_(scales)
    # phase 4: p *= 1 - lr·wd (torch's form), then p += -scale·u
    if o.weight_decay != 0:
        assert o.lr is not None
        if isinstance(o.lr, Tensor):
            factor = o.lr.mul(-o.weight_decay).add_(1.0).to(params[0].dtype)  # as a float's
            torch._foreach_mul_(params, factor)
        else:
            _mul_(params, [1.0 - o.lr * o.weight_decay] * len(params))
    torch._foreach_addcmul_(params, updates, scales)
    return works, lr_ts


def _per_work(works: list[Work], fn: Callable[[int], _T]) -> list[_T]:
    """`fn` of each work's step count; eagerly of the first's (a batch has one step count)."""
    if compile_safe_scalars():
        return [fn(w.step) for w in works]
    return [fn(works[0].step)] * len(works)


def _mul_(xs: list[Tensor], coefs: list[Scalar]) -> None:
    """`x *= coef` for each pair: eagerly one `_foreach_mul_` by the (shared) first coefficient.

    Inside `torch.compile` one tensor at a time: see `step`.
    """
    if compile_safe_scalars():
        for x, coef in zip(xs, coefs, strict=True):
            x.mul_(coef)
    else:
        torch._foreach_mul_(xs, coefs[0])


def _lerp_(avgs: list[Tensor], targets: list[Tensor], weights: list[float]) -> None:
    """`avg.lerp_(target, weight)` for each: eagerly one `_foreach_lerp_` (see `_mul_`)."""
    if compile_safe_scalars():
        for avg, target, weight in zip(avgs, targets, weights, strict=True):
            avg.lerp_(target, weight)
    else:
        torch._foreach_lerp_(avgs, targets, weights[0])


def _matrix_updates(works: list[Work], weights: list[float], eps1: float) -> list[Tensor]:
    """Row/column EMAs of mean g² lerped in; `u = g · rsqrt(clamp(r⊗c / max(mean r, ε1), ε1²))`."""
    if not works:
        return []
    grads = [w.grad for w in works]
    rows = [w.state["exp_avg_sq_row"] for w in works]
    cols = [w.state["exp_avg_sq_col"] for w in works]
    gsq = list(torch._foreach_mul(grads, grads))  # becomes u (the same shapes)
    row_in = [x.sum(dim=-1) for x in gsq]
    torch._foreach_div_(row_in, [g.shape[-1] for g in grads])
    _lerp_(rows, row_in, weights)
    col_in = [x.sum(dim=-2) for x in gsq]
    torch._foreach_div_(col_in, [w.rows for w in works])
    _lerp_(cols, col_in, weights)
    norms = [r.sum(dim=-1) for r in rows]
    torch._foreach_div_(norms, [w.rows for w in works])
    torch._foreach_clamp_min_(norms, eps1)
    for u, r, c, norm in zip(gsq, rows, cols, norms, strict=True):
        torch.mul(r.unsqueeze(-1), c.unsqueeze(-2), out=u)
        u.div_(norm.unsqueeze(-1).unsqueeze(-1))
    torch._foreach_clamp_min_(gsq, eps1 * eps1)
    torch._foreach_rsqrt_(gsq)
    torch._foreach_mul_(gsq, grads)
    return gsq


def _vector_updates(works: list[Work], weights: list[float], eps1: float) -> list[Tensor]:
    """The full second moment `v` lerped to g²; `u = g · rsqrt(clamp(v, ε1²))`."""
    if not works:
        return []
    grads = [w.grad for w in works]
    variances = [w.state["exp_avg_sq"] for w in works]
    gsq = torch._foreach_mul(grads, grads)
    _lerp_(variances, list(gsq), weights)
    updates = list(torch._foreach_clamp_min(variances, eps1 * eps1))
    torch._foreach_rsqrt_(updates)
    torch._foreach_mul_(updates, grads)
    return updates
