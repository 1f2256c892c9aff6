"""Forward KL between teacher and student logits, plain and memory-lean (chunked).

``loss = T^2 * sum_n w_n * KL(softmax(t_n / T) || softmax(s_n / T))`` over token rows ``n`` with
weights ``w`` (by default ``1 / number of valid tokens``), i.e. Hinton et al.'s temperature-scaled
KD loss as Minitron uses it (forward KL, T = 1 by default). With ``top_k`` the teacher distribution
is renormalised over its top-k logits and the student's log-probabilities are read at those
indices; with ``k = vocab size`` this is the full loss.

The chunked path computes the loss and the gradient w.r.t. the student logits together, one chunk
of rows at a time, in fp32: ``dL/ds_n = w_n * T * (softmax(s_n / T) - q_n)`` where ``q_n`` is the
(possibly top-k, scattered) teacher distribution. It never holds the log-softmax of both full
(N, V) tensors, only one chunk of each plus the gradient (in the logits' dtype).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

TopK = tuple[torch.Tensor, torch.Tensor]
"""Teacher top-k logits: (values (N, k), indices (N, k))."""


def _target_logprobs(
    teacher: torch.Tensor | TopK, rows: slice, temperature: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Teacher log-probabilities for `rows` (fp32) and their vocab indices (None = dense)."""
    if isinstance(teacher, tuple):
        values, indices = teacher
        return F.log_softmax(values[rows].float() / temperature, dim=-1), indices[rows]
    return F.log_softmax(teacher[rows].float() / temperature, dim=-1), None


def _kl_rows(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, indices: torch.Tensor | None
) -> torch.Tensor:
    if indices is not None:
        student_logp = student_logp.gather(-1, indices)
    return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)


class _ChunkedKL(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: PLR0917 (autograd passes inputs positionally)
        ctx: Any,
        student: torch.Tensor,
        teacher: Any,
        weights: torch.Tensor,
        temperature: float,
        chunk_size: int,
    ) -> torch.Tensor:
        n = student.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        grad = torch.empty_like(student) if ctx.needs_input_grad[0] else None
        scale = temperature * temperature
        for start in range(0, n, chunk_size):
            rows = slice(start, min(start + chunk_size, n))
            w = weights[rows].float()
            logp_s = F.log_softmax(student[rows].float() / temperature, dim=-1)
            logp_t, indices = _target_logprobs(teacher, rows, temperature)
            total += (_kl_rows(logp_s, logp_t, indices) * w).sum()
            if grad is not None:
                g = logp_s.exp_()  # softmax(s / T), reusing the buffer
                if indices is None:
                    g -= logp_t.exp()
                else:
                    g.scatter_add_(-1, indices, -logp_t.exp())
                g *= (w * temperature)[:, None]
                grad[rows] = g.to(grad.dtype)
        ctx.save_for_backward(grad)
        return total * scale

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        (grad,) = ctx.saved_tensors
        return grad * grad_out.to(grad.dtype), None, None, None, None


def forward_kl(
    student_logits: torch.Tensor,
    teacher: torch.Tensor | TopK,
    *,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = 1024,
) -> torch.Tensor:
    """Temperature-scaled forward KL from the teacher to the student, mean over valid tokens.

    Args:
        student_logits: (..., V) student logits (gradients flow into them).
        teacher: (..., V) teacher logits, or a `TopK` pair ``(values, indices)`` of shape (..., k)
            each (e.g. ``torch.topk(teacher_logits, k)``; indices into the student's vocab).
        mask: (...) 1 for tokens that count, 0 for padding; None counts every token.
        temperature: T; the loss is multiplied by T^2 so gradient scales match T = 1.
        chunk_size: token rows per chunk of the memory-lean path; None uses plain autograd (the
            reference implementation).

    Returns:
        A scalar fp32 loss.
    """
    if temperature <= 0:
        raise ValueError(f"`temperature` ({temperature}) must be > 0")
    vocab = student_logits.shape[-1]
    s = student_logits.reshape(-1, vocab)
    if isinstance(teacher, tuple):
        values, indices = teacher
        k = values.shape[-1]
        t: torch.Tensor | TopK = (values.reshape(-1, k), indices.reshape(-1, k).long())
        lead = values.shape[:-1]
    else:
        if teacher.shape[-1] != vocab:
            raise ValueError(
                f"teacher vocab ({teacher.shape[-1]}) != student vocab ({vocab}): distillation "
                "needs the same tokenizer and vocabulary size"
            )
        t = teacher.reshape(-1, vocab)
        lead = teacher.shape[:-1]
    if lead != student_logits.shape[:-1]:
        raise ValueError(
            f"teacher shape {tuple(lead)} != student shape {tuple(student_logits.shape[:-1])}"
        )
    if mask is None:
        weights = torch.full((s.shape[0],), 1.0 / max(s.shape[0], 1), device=s.device)
    else:
        m = mask.reshape(-1).float()
        weights = m / m.sum().clamp_min(1.0)
    if chunk_size is None:
        logp_s = F.log_softmax(s.float() / temperature, dim=-1)
        logp_t, idx = _target_logprobs(t, slice(None), temperature)
        return (_kl_rows(logp_s, logp_t, idx) * weights).sum() * temperature**2
    if chunk_size < 1:
        raise ValueError(f"`chunk_size` ({chunk_size}) must be >= 1 or None")
    out = _ChunkedKL.apply(s, t, weights, temperature, chunk_size)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out
