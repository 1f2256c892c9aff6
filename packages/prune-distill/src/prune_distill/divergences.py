"""Reverse KL and generalized JSD between teacher and student logits; `divergence` picks a loss.

The alternatives to `forward_kl` (`prune_distill.losses`) for distillation, with the same
arguments, token weights, ``T²`` scale and paths: ``chunk_size=None`` is plain autograd (the
reference), ``backend="torch"`` the chunked path (loss and analytic student gradient one chunk
of rows at a time, in fp32; the teacher's gradient too when it requires grad),
``backend="triton"`` the fused kernels of `_divergence_kernels` (dense teacher not requiring
grad; CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"auto"`` the kernel for such a teacher on
CUDA, else chunked. Tokens of probability 0 (``-inf`` logits) add ``0 · log 0 = 0``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from prune_distill._divergence_kernels import divergence_rows
from prune_distill.config import Backend, LossName, _check_number, check_loss
from prune_distill.losses import (
    TopK,
    _as_teacher,
    _target_logprobs,
    consume_grads,
    flatten_inputs,
    forward_kl,
    resolve_path,
    student_chunks,
)


def _teacher_logp(
    teacher: torch.Tensor | TopK, rows: slice, temperature: float, vocab: int
) -> torch.Tensor:
    """Dense fp32 teacher log-probabilities for `rows`; ``-inf`` outside a top-k teacher's k."""
    logp, indices = _target_logprobs(teacher, rows, temperature)
    if indices is None:
        return logp
    dense = logp.new_full((logp.shape[0], vocab), float("-inf"))
    return dense.scatter_(-1, indices, logp)


class _ChunkedDivergence(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: PLR0917 (autograd passes inputs positionally)
        ctx: Any, student: torch.Tensor, values: torch.Tensor, indices: torch.Tensor | None,
        weights: torch.Tensor, temperature: float, chunk_size: int, kind: str, beta: float,
    ) -> torch.Tensor:  # fmt: skip
        teacher = _as_teacher(values, indices)  # a tuple would hide `values` from autograd
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        grad = torch.empty_like(student) if ctx.needs_input_grad[0] else None
        teacher_grad = torch.empty_like(values) if ctx.needs_input_grad[1] else None
        for rows, w, log_q in student_chunks(student, weights, temperature, chunk_size):
            log_p = _teacher_logp(teacher, rows, temperature, student.shape[-1])
            div, grad_a, grad_b = divergence_rows(
                kind, log_q, log_p, beta, need_grad=grad is not None,
                need_teacher_grad=teacher_grad is not None,
            )  # fmt: skip
            total += (div * w).sum()
            scale = (w * temperature)[:, None]  # d/ds = (1/T) d/da, times T²; the same for t
            if grad is not None and grad_a is not None:
                grad[rows] = (grad_a * scale).to(grad.dtype)
            if teacher_grad is not None and grad_b is not None:
                if indices is not None:  # only the top-k values move the teacher's log p
                    grad_b = grad_b.gather(-1, indices[rows])
                teacher_grad[rows] = (grad_b * scale).to(teacher_grad.dtype)
        ctx.grad, ctx.teacher_grad = grad, teacher_grad
        return total * temperature * temperature

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        return *consume_grads(ctx, grad_out), None, None, None, None, None, None


class _FusedDivergence(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: PLR0917
        ctx: Any,
        student: torch.Tensor,
        teacher: torch.Tensor,
        weights: torch.Tensor,
        temperature: float,
        kind: str,
        beta: float,
    ) -> torch.Tensor:
        from prune_distill import _divergence_kernels

        rows, grad = _divergence_kernels.fused_divergence(
            kind, student, teacher, weights, temperature, beta=beta,
            need_grad=ctx.needs_input_grad[0],
        )  # fmt: skip
        ctx.grad, ctx.teacher_grad = grad, None  # `resolve_path` refuses a teacher needing grad
        return rows.sum()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        return *consume_grads(ctx, grad_out), None, None, None, None


def _divergence(
    kind: str,
    student_logits: torch.Tensor,
    teacher: torch.Tensor | TopK,
    *,
    beta: float,
    mask: torch.Tensor | None,
    temperature: float,
    chunk_size: int | None,
    backend: Backend,
) -> torch.Tensor:
    _check_number("temperature", temperature, low=0.0, strict=True)  # DistillConfig's check
    check_loss(kind, beta, top_k=isinstance(teacher, tuple))
    s, t, weights = flatten_inputs(student_logits, teacher, mask)
    path = resolve_path(backend, t, s.device, chunk_size)
    if path == "plain":  # the reference: the same math, gradient by autograd
        log_q = F.log_softmax(s.float() / temperature, dim=-1)
        log_p = _teacher_logp(t, slice(None), temperature, s.shape[-1])
        div, _, _ = divergence_rows(kind, log_q, log_p, beta, need_grad=False)
        return (div * weights).sum() * temperature**2
    if path == "triton":
        assert isinstance(t, torch.Tensor)
        out = _FusedDivergence.apply(s, t, weights, temperature, kind, beta)  # type: ignore[no-untyped-call]
    else:
        values, indices = t if isinstance(t, tuple) else (t, None)
        out = _ChunkedDivergence.apply(  # type: ignore[no-untyped-call]
            s, values, indices, weights, temperature, chunk_size, kind, beta
        )
    assert isinstance(out, torch.Tensor)
    return out


def reverse_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = 1024,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Temperature-scaled reverse KL(student || teacher), mean over valid tokens.

    ``T² Σ_n w_n KL(q_n || p_n)`` with ``q = softmax(s / T)``, ``p = softmax(t / T)`` (mode
    seeking; MiniLLM, arXiv 2306.08543). The arguments are `forward_kl`'s (`mask`, `temperature`
    with the T² scale, `chunk_size`, `backend`), except that `teacher_logits` must be dense
    (..., V) logits: against a top-k teacher the reverse KL is infinite wherever the student has
    mass outside the k tokens, so it is refused. Returns a scalar fp32 loss.
    """
    return _divergence(
        "reverse_kl", student_logits, teacher_logits, beta=1.0, mask=mask,
        temperature=temperature, chunk_size=chunk_size, backend=backend,
    )  # fmt: skip


def jsd(
    student_logits: torch.Tensor,
    teacher: torch.Tensor | TopK,
    *,
    beta: float = 0.5,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = 1024,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Temperature-scaled generalized JSD between teacher and student, mean over valid tokens.

    ``T² Σ_n w_n [β KL(p_n || m_n) + (1-β) KL(q_n || m_n)]`` with ``m = β p + (1-β) q``: GKD's
    generalized JSD (arXiv 2306.13649) in TRL's and Liger-Kernel's convention. `beta` is the
    teacher's weight in the mixture, in [0, 1]: 0 is `forward_kl`, 1 `reverse_kl` (where the
    mixture formula would give 0; then a `TopK` teacher is refused), 0.5 the symmetric JSD,
    bounded by ``log 2``. With ``β < 1`` a top-k teacher (renormalised over its k tokens) keeps
    the loss finite (``m >= (1-β) q``) and runs on the chunked path. The other arguments are
    `forward_kl`'s. Returns a scalar fp32 loss.
    """
    return divergence(
        student_logits, teacher, loss="jsd", beta=beta, mask=mask, temperature=temperature,
        chunk_size=chunk_size, backend=backend,
    )  # fmt: skip


def divergence(
    student_logits: torch.Tensor,
    teacher: torch.Tensor | TopK,
    *,
    loss: LossName = "forward_kl",
    beta: float = 0.5,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = 1024,
    backend: Backend = "auto",
) -> torch.Tensor:
    """The distillation loss named `loss`: `forward_kl`, `reverse_kl` or `jsd` (with `beta`).

    The other arguments are those functions' (`beta` is read by ``"jsd"`` only, but checked to be
    in [0, 1] always). Raises ValueError naming `loss` or `beta` for an unknown name or a value
    out of range, and for a reverse KL against a top-k teacher.
    """
    check_loss(loss, beta, top_k=isinstance(teacher, tuple))
    if loss == "jsd" and beta in (0.0, 1.0):  # JSD's endpoints are the two KLs
        loss = "forward_kl" if beta == 0.0 else "reverse_kl"
    kw: dict[str, Any] = {
        "mask": mask, "temperature": temperature, "chunk_size": chunk_size, "backend": backend,
    }  # fmt: skip
    if loss == "forward_kl":
        return forward_kl(student_logits, teacher, **kw)
    if loss == "reverse_kl":
        assert isinstance(teacher, torch.Tensor)  # check_loss refused a top-k teacher
        return reverse_kl(student_logits, teacher, **kw)
    return _divergence("jsd", student_logits, teacher, beta=beta, **kw)
