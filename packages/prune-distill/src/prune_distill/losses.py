"""Forward KL between teacher and student logits, plain and memory-lean (chunked).

``loss = T² Σ_n w_n KL(softmax(t_n / T) || softmax(s_n / T))`` over token rows with weights ``w``
(``1 / number of valid tokens`` by default): Hinton et al.'s KD loss as Minitron uses it. With a
top-k teacher its distribution is renormalised over its k logits. The chunked path computes the
loss and ``dL/ds_n = w_n T (softmax(s_n / T) - q_n)`` one chunk of rows at a time in fp32, so it
never holds the log-softmax of both full (N, V) tensors; it and the fused kernel (`_kl_kernels`)
save only the gradient for backward, scaled in place, so their backward runs once per forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from prune_distill.config import Backend

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
        ctx: Any, student: torch.Tensor, teacher: Any, weights: torch.Tensor, temperature: float,
        chunk_size: int,
    ) -> torch.Tensor:  # fmt: skip
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        grad = torch.empty_like(student) if ctx.needs_input_grad[0] else None
        scale = temperature * temperature
        for rows, w, logp_s in student_chunks(student, weights, temperature, chunk_size):
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
        ctx.grad = grad
        return total * scale

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        return consume_grad(ctx, grad_out), None, None, None, None


class _FusedKL(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        student: torch.Tensor,
        teacher: torch.Tensor,
        weights: torch.Tensor,
        temperature: float,
    ) -> torch.Tensor:
        from prune_distill import _kl_kernels

        rows, grad = _kl_kernels.fused_kl(
            student, teacher, weights, temperature, need_grad=ctx.needs_input_grad[0]
        )
        ctx.grad = grad
        return rows.sum()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        return consume_grad(ctx, grad_out), None, None, None


def student_chunks(
    student: torch.Tensor, weights: torch.Tensor, temperature: float, chunk_size: int
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """Per chunk of `chunk_size` rows: the rows, their fp32 weights and student log-probs at T."""
    n = student.shape[0]
    for start in range(0, n, chunk_size):
        rows = slice(start, min(start + chunk_size, n))
        w = weights[rows].float()
        yield rows, w, F.log_softmax(student[rows].float() / temperature, dim=-1)


def consume_grad(ctx: Any, grad_out: torch.Tensor) -> torch.Tensor | None:
    """The gradient saved by forward, scaled by `grad_out` in place (no second (N, V) buffer).

    Kept as a plain attribute, not `save_for_backward`, because it is modified in place and handed
    to autograd; it is released here, so a second backward through the same graph fails loudly.
    """
    grad: torch.Tensor | None = ctx.grad
    if grad is None:
        if ctx.needs_input_grad[0]:
            raise RuntimeError(
                "forward_kl's saved gradient was consumed by an earlier backward: the memory-lean "
                "paths support one backward per forward (recompute the loss, or use "
                "chunk_size=None for retain_graph)"
            )
        return None
    ctx.grad = None
    return grad.mul_(grad_out.to(grad.dtype))


def resolve_path(
    backend: str, teacher: torch.Tensor | TopK, device: torch.device, chunk_size: int | None
) -> str:
    """`"plain"` (autograd reference), `"torch"` (chunked) or `"triton"`, with the checks."""
    chosen = _resolve_backend(backend, teacher, device)
    if chunk_size is None:
        if backend == "triton":
            raise ValueError(
                "`chunk_size` None selects the plain autograd reference, which conflicts with "
                "`backend` 'triton': pass an int chunk size (ignored by the kernel) or "
                "backend='torch'"
            )
        return "plain"
    if chunk_size < 1:
        raise ValueError(f"`chunk_size` ({chunk_size}) must be >= 1 or None")
    return chosen


def _resolve_backend(backend: str, teacher: torch.Tensor | TopK, device: torch.device) -> str:
    """`"torch"` or `"triton"` for `backend`, the teacher's form and `device`."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"`backend` ({backend!r}) must be 'auto', 'torch' or 'triton'")
    if backend == "torch":
        return backend
    from prune_distill import _kl_kernels

    dense = not isinstance(teacher, tuple)
    if backend == "auto":
        return "triton" if dense and device.type == "cuda" and _kl_kernels.HAS_TRITON else "torch"
    if not dense:
        raise ValueError(
            "backend 'triton' takes dense teacher logits only; a top-k teacher runs on the "
            "chunked PyTorch path (backend='auto' or 'torch')"
        )
    if not _kl_kernels.available(device):
        raise ValueError(
            "backend 'triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 set before "
            f"import on CPU); got {device} with triton "
            f"{'installed' if _kl_kernels.HAS_TRITON else 'not installed'}"
        )
    return backend


def flatten_inputs(
    student_logits: torch.Tensor, teacher: torch.Tensor | TopK, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | TopK, torch.Tensor]:
    """Token rows: student (N, V), teacher (N, V) or top-k (N, k) pair, row weights (N,).

    The weights are ``mask / number of valid tokens`` (``1 / N`` without a mask). Raises a
    ValueError naming the mismatch for a teacher of another vocabulary or shape.
    """
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
    return s, t, weights


def forward_kl(
    student_logits: torch.Tensor,
    teacher: torch.Tensor | TopK,
    *,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = 1024,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Temperature-scaled forward KL from the teacher to the student, mean over valid tokens.

    Args:
        student_logits: (..., V) student logits (gradients flow into them).
        teacher: (..., V) teacher logits, or a `TopK` pair ``(values, indices)`` of shape (..., k)
            each (e.g. ``torch.topk(teacher_logits, k)``; indices into the student's vocab).
        mask: (...) 1 for tokens that count, 0 for padding; None counts every token.
        temperature: T; the loss is multiplied by T^2 so gradient scales match T = 1.
        chunk_size: token rows per chunk of the chunked PyTorch path; None uses plain autograd
            (the reference implementation, whatever `backend` says unless it is ``"triton"``,
            which then raises). The Triton kernel ignores it (it streams one row at a time).
        backend: ``"torch"`` (chunked / plain PyTorch), ``"triton"`` (the fused kernel: dense
            teacher, CUDA or ``TRITON_INTERPRET=1``) or ``"auto"`` (Triton for a dense teacher on
            CUDA when Triton is installed, else ``"torch"``).

    Returns:
        A scalar fp32 loss.
    """
    if temperature <= 0:
        raise ValueError(f"`temperature` ({temperature}) must be > 0")
    s, t, weights = flatten_inputs(student_logits, teacher, mask)
    chosen = resolve_path(backend, t, s.device, chunk_size)
    if chosen == "plain":
        logp_s = F.log_softmax(s.float() / temperature, dim=-1)
        logp_t, idx = _target_logprobs(t, slice(None), temperature)
        return (_kl_rows(logp_s, logp_t, idx) * weights).sum() * temperature**2
    if chosen == "triton":
        assert isinstance(t, torch.Tensor)
        out = _FusedKL.apply(s, t, weights, temperature)  # type: ignore[no-untyped-call]
        assert isinstance(out, torch.Tensor)
        return out
    out = _ChunkedKL.apply(s, t, weights, temperature, chunk_size)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out
