# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""Fused reverse KL and generalized JSD: loss and student-logit gradient, no (N, V) temps.

The reverse KL (MiniLLM's, arXiv 2306.08543) is `_kl_kernels`' KL kernel with ``REVERSE``; the
JSD kernel here has the same design (one program per token row, the vocabulary streamed in
``BLOCK_V`` chunks, online log-sum-exp, fp32 math right after the loads). The generalized JSD
is GKD's (arXiv 2306.13649) in TRL's and
Liger-Kernel's convention, ``β`` weighting the teacher in ``m = β p + (1-β) q``; the kernel takes
``0 < β < 1`` and `prune_distill.divergences` dispatches the endpoints to the two KLs.
`fused_divergence_reference` is the tests' PyTorch statement of the contract.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from prune_distill._kl_kernels import DTYPES, HAS_TRITON, block_and_warps, launch

if HAS_TRITON:
    import triton
    import triton.language as tl

    from prune_distill._kl_kernels import (
        LOG_ZERO,
        LOWEST,
        _kl_kernel,
        online_lse,
        row_starts,
        scaled_block,
    )

    @triton.jit
    def log_mixture(log_p, log_q, log_beta, log_1m_beta):  # type: ignore[no-untyped-def]
        """``log m`` of the JSD's mixture: ``logaddexp(log β + log p, log(1-β) + log q)``.

        `log_p` and `log_q` are finite (floored at `LOG_ZERO`), so the shift `hi` is too.
        """
        x = log_p + log_beta
        y = log_q + log_1m_beta
        hi = tl.maximum(x, y)
        return hi + tl.log(tl.exp(x - hi) + tl.exp(y - hi))

    @triton.jit  # type: ignore[untyped-decorator]
    def _jsd_kernel(  # type: ignore[no-untyped-def]
        s_ptr, t_ptr, w_ptr, grad_ptr, loss_ptr, n_cols, stride_s, stride_t, stride_g, inv_temp,
        temp, beta, log_beta, log_1m_beta, HAS_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        """Row ``pid``: ``loss = T²·w·(β KL(p||m) + (1-β) KL(q||m))`` and its student gradient.

        ``grad = w·T·(1-β)·q ⊙ (log q - log m - KL(q||m))``: ``∂JSD/∂q_v = (1-β) log(q_v/m_v)``
        (the ``p/m`` and ``q/m`` terms cancel since ``β p + (1-β) q = m``), then the softmax
        Jacobian subtracts the ``q``-weighted mean. ``log m`` needs both final normalisers, so
        three sweeps: online log-sum-exp of ``a`` and ``b``; both KL terms, with
        ``log m = logaddexp(log β + log p, log(1-β) + log q)``; the gradient. The terms are sums
        of ``p (log p - log m)`` over log-probabilities (no ``lse(a) - lse(b)`` cancellation).
        A lane of probability 0 (padding, or a ``-inf`` logit) adds ``0 · log 0 = 0``, and so
        does its gradient: log-probabilities are floored at `LOG_ZERO` (finite, ``exp`` of it 0),
        so the product is ``0 · finite`` where ``-inf`` would give nan. Every real
        log-probability is above the floor, so the other lanes are unchanged.
        """
        row, s_row, t_row = row_starts(s_ptr, t_ptr, stride_s, stride_t)
        m_s = LOWEST
        d_s = 0.0
        m_t = LOWEST
        d_t = 0.0
        for start in range(0, n_cols, BLOCK_V):  # sweep 1: both log-sum-exps
            cols = start + tl.arange(0, BLOCK_V)
            valid = cols < n_cols
            a = tl.load(s_row + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
            b = tl.load(t_row + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
            m_s, d_s, _, _ = online_lse(m_s, d_s, a)
            m_t, d_t, _, _ = online_lse(m_t, d_t, b)
        lse_s = m_s + tl.log(d_s)
        lse_t = m_t + tl.log(d_t)
        kl_pm = 0.0  # Σ p (log p - log m)
        kl_qm = 0.0  # Σ q (log q - log m)
        for start in range(0, n_cols, BLOCK_V):  # sweep 2: both KL terms to the mixture
            cols, valid, a, b = scaled_block(s_row, t_row, start, n_cols, inv_temp, BLOCK_V)
            # padding lanes: finite log-probs (logits 0) but probability 0, so they add 0
            log_q = tl.maximum(a - lse_s, LOG_ZERO)
            log_p = tl.maximum(b - lse_t, LOG_ZERO)
            log_m = log_mixture(log_p, log_q, log_beta, log_1m_beta)
            p = tl.where(valid, tl.exp(log_p), 0.0)
            q = tl.where(valid, tl.exp(log_q), 0.0)
            kl_pm += tl.sum(p * (log_p - log_m), axis=0)
            kl_qm += tl.sum(q * (log_q - log_m), axis=0)
        w = tl.load(w_ptr + row).to(tl.float32)
        tl.store(loss_ptr + row, (beta * kl_pm + (1.0 - beta) * kl_qm) * w * temp * temp)
        if HAS_GRAD:  # sweep 3
            g_row = grad_ptr + row * stride_g
            scale = w * temp * (1.0 - beta)
            for start in range(0, n_cols, BLOCK_V):
                cols, valid, a, b = scaled_block(s_row, t_row, start, n_cols, inv_temp, BLOCK_V)
                log_q = tl.maximum(a - lse_s, LOG_ZERO)
                log_m = log_mixture(tl.maximum(b - lse_t, LOG_ZERO), log_q, log_beta, log_1m_beta)
                g = tl.exp(log_q) * (log_q - log_m - kl_qm) * scale
                tl.store(g_row + cols, g.to(grad_ptr.dtype.element_ty), mask=valid)


KINDS = ("reverse_kl", "jsd")
"""The divergences this module's kernels compute."""


# ---------------------------------------------------------------------------------- reference
def divergence_rows(
    kind: str,
    log_q: Tensor,
    log_p: Tensor,
    beta: float,
    *,
    need_grad: bool = True,
    need_teacher_grad: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Per-row divergence (N,) and its gradients w.r.t. the scaled logits ``a`` and ``b`` (N, V).

    `log_q` / `log_p` are fp32 student / teacher log-probabilities; either may hold ``-inf``
    (probability 0: a masked id, or outside a top-k teacher). Terms of probability 0 add 0
    (``0 · log 0 = 0``), also where both are ``-inf``. The math of the kernels, in PyTorch; the
    chunked path and `fused_divergence_reference` both use it, and the plain autograd reference
    uses its loss with ``need_grad=False``: every log difference is masked *before* it is
    multiplied, so autograd's gradient is finite there too. Returns ``(rows, d rows / d a,
    d rows / d b)``, a gradient None unless asked for.
    """
    q = log_q.exp()
    if kind == "reverse_kl":
        r = q * torch.where(q > 0, log_q - log_p, 0.0)
        rows = r.sum(-1)
        grad_a = r - q * rows[:, None] if need_grad else None
        return rows, grad_a, log_p.exp() - q if need_teacher_grad else None
    assert kind == "jsd", kind
    assert 0.0 < beta < 1.0, beta
    # log m = logaddexp(log β + log p, log(1-β) + log q); where both are -inf it is never read,
    # but logaddexp's backward at (-inf, -inf) is nan even for a zero incoming gradient
    dead = (log_p == float("-inf")) & (log_q == float("-inf"))
    log_m = torch.logaddexp(
        log_p.masked_fill(dead, 0.0) + math.log(beta),
        log_q.masked_fill(dead, 0.0) + math.log1p(-beta),
    )
    p = log_p.exp()
    t_pm = p * torch.where(p > 0, log_p - log_m, 0.0)
    t_qm = q * torch.where(q > 0, log_q - log_m, 0.0)
    kl_pm, kl_qm = t_pm.sum(-1), t_qm.sum(-1)
    rows = beta * kl_pm + (1.0 - beta) * kl_qm
    grad_a = (1.0 - beta) * (t_qm - q * kl_qm[:, None]) if need_grad else None
    grad_b = beta * (t_pm - p * kl_pm[:, None]) if need_teacher_grad else None
    return rows, grad_a, grad_b


def fused_divergence_reference(
    kind: str,
    student: Tensor,
    teacher: Tensor,
    weights: Tensor,
    temperature: float,
    *,
    beta: float = 0.5,
    need_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """PyTorch statement of `fused_divergence`'s contract (fp32 (N, V) temporaries: tests only)."""
    log_q = F.log_softmax(student.float() / temperature, dim=-1)
    log_p = F.log_softmax(teacher.float() / temperature, dim=-1)
    rows, grad_a, _ = divergence_rows(kind, log_q, log_p, beta, need_grad=need_grad)
    w = weights.float()
    loss = rows * w * temperature * temperature
    if grad_a is None:
        return loss, None
    return loss, (grad_a * (w * temperature)[:, None]).to(student.dtype)


# ---------------------------------------------------------------------------------- launcher
if HAS_TRITON:

    def gpu_launch_configs() -> list[dict[str, Any]]:
        """Every launch `fused_divergence` makes on a GPU (for tools/gpu_compile.py).

        The reverse KL (`_kl_kernel` with ``REVERSE``) and the JSD kernel, with and without the
        gradient, at a 1000-word vocabulary (one 1024-wide block, 4 warps; unaligned) and at
        Llama-3's 128256 (4096-wide blocks, 8 warps), for student / teacher logits of one dtype
        (fp32, bf16, fp16) and the fp32 / bf16 mixes. The other mixes (with fp16) compile the
        same code with another load type; they are left out to keep CI's compile job short (the
        forward KL lists all nine pairs).
        """
        pairs = [(d, d) for d in DTYPES] + [
            (torch.float32, torch.bfloat16),
            (torch.bfloat16, torch.float32),
        ]
        launches: list[dict[str, Any]] = []
        jsd = {"beta": 0.5, "log_beta": -0.69, "log_1m_beta": -0.69}
        kernels = ((_kl_kernel, {"REVERSE": True}), (_jsd_kernel, jsd))
        for (kernel, extra), (s_dtype, t_dtype), vocab, grad in itertools.product(
            kernels, pairs, (1000, 128256), (False, True)
        ):
            block, warps = block_and_warps(vocab)
            args = {"s_ptr": s_dtype, "t_ptr": t_dtype, "w_ptr": torch.float32,
                    "grad_ptr": s_dtype if grad else torch.float32, "loss_ptr": torch.float32,
                    "n_cols": vocab, "stride_s": vocab, "stride_t": vocab, "stride_g": vocab,
                    "inv_temp": 0.5, "temp": 2.0, **extra,
                    "HAS_GRAD": grad, "BLOCK_V": block}  # fmt: skip
            launches.append({"kernel": kernel, "args": args, "options": {"num_warps": warps}})
        return launches


def fused_divergence(
    kind: str,
    student: Tensor,
    teacher: Tensor,
    weights: Tensor,
    temperature: float,
    *,
    beta: float = 0.5,
    need_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """Per-row weighted reverse KL or JSD (N,) fp32 and, if asked, the `student` gradient.

    Args:
        kind: ``"reverse_kl"`` or ``"jsd"``.
        student: (N, V) fp32/bf16/fp16 student logits, unit stride along V (rows may be strided).
        teacher: (N, V) teacher logits of any of those dtypes, on the same device.
        weights: (N,) row weights (fp32); the loss is ``Σ_n out[n]``.
        temperature: T > 0.
        beta: JSD's teacher weight in the mixture, strictly between 0 and 1 (ignored otherwise).
        need_grad: also write the gradient (module docstring) in `student`'s dtype.

    Returns:
        ``(loss_rows, grad)`` with ``loss_rows[n] = T²·w_n·D_n`` and grad None unless asked.

    Raises:
        ValueError: an unknown `kind`, `beta` outside (0, 1) for JSD, or inputs the kernel cannot
            take (as `_kl_kernels.fused_kl`).
        TypeError: for a dtype other than fp32/bf16/fp16.
    """
    if kind not in KINDS:
        raise ValueError(f"`kind` ({kind!r}) must be one of {KINDS}")
    if kind == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(
            f"`beta` ({beta}) must be strictly between 0 and 1 for the JSD kernel (0 and 1 are "
            "the forward and reverse KL: use those kernels)"
        )
    if kind == "reverse_kl":
        kernel = _kl_kernel if HAS_TRITON else None
        return launch(
            kernel, student, teacher, weights, temperature, need_grad=need_grad, REVERSE=True
        )
    kernel = _jsd_kernel if HAS_TRITON else None
    extra = (float(beta), math.log(beta), math.log1p(-beta))
    return launch(kernel, student, teacher, weights, temperature, *extra, need_grad=need_grad)
