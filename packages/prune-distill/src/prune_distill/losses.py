"""Forward KL between teacher and student logits, plain and memory-lean (chunked).

``loss = T² Σ_n w_n KL(softmax(t_n / T) || softmax(s_n / T))`` over token rows with weights ``w``
(``1 / number of valid tokens`` by default): Hinton et al.'s KD loss as Minitron uses it. With a
top-k teacher its distribution is renormalised over its k logits. The chunked path computes the
loss and ``dL/ds_n = w_n T (softmax(s_n / T) - q_n)`` one chunk of rows at a time in fp32, so it
never holds the log-softmax of both full (N, V) tensors; it and the fused kernel (`_kl_kernels`)
save only the gradient for backward, scaled in place, so their backward runs once per forward.
A teacher token of probability 0 (a ``-inf`` logit) adds ``0 · log 0 = 0``, also where the student
is ``-inf`` too. A teacher that requires grad gets its gradient on the chunked path as on the
plain one (``w_n T p_n ⊙ (log p_n - log q_n - KL_n)``, computed beside the student's); the kernel
computes the student's only, so ``"auto"`` then takes the chunked path and ``"triton"`` raises.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from prune_distill.config import Backend, _check_number

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
    """``Σ p (log p - log q)`` per row, a term with ``p = 0`` counting 0 (xlogy semantics)."""
    if indices is not None:
        student_logp = student_logp.gather(-1, indices)
    p = teacher_logp.exp()
    # mask the log difference, not the product: -inf - x (or -inf - -inf) would make both the
    # value and, through autograd, the gradient nan even where p is 0
    return (p * torch.where(p > 0, teacher_logp - student_logp, 0.0)).sum(-1)


def _kl_teacher_grad(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    indices: torch.Tensor | None,
    kl: torch.Tensor,
) -> torch.Tensor:
    """The gradient of KL_n w.r.t. ``t_n / T``: ``p ⊙ (log p - log q - KL_n)``, 0 where p = 0."""
    if indices is not None:
        student_logp = student_logp.gather(-1, indices)
    p = teacher_logp.exp()
    return p * torch.where(p > 0, teacher_logp - student_logp - kl[:, None], 0.0)


def _as_teacher(values: torch.Tensor, indices: torch.Tensor | None) -> torch.Tensor | TopK:
    return values if indices is None else (values, indices)


class _ChunkedKL(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: PLR0917 (autograd passes inputs positionally)
        ctx: Any, student: torch.Tensor, values: torch.Tensor, indices: torch.Tensor | None,
        weights: torch.Tensor, temperature: float, chunk_size: int,
    ) -> torch.Tensor:  # fmt: skip
        teacher = _as_teacher(values, indices)  # a tuple would hide `values` from autograd
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        grad = torch.empty_like(student) if ctx.needs_input_grad[0] else None
        teacher_grad = torch.empty_like(values) if ctx.needs_input_grad[1] else None
        scale = temperature * temperature
        for rows, w, logp_s in student_chunks(student, weights, temperature, chunk_size):
            logp_t, idx = _target_logprobs(teacher, rows, temperature)
            kl = _kl_rows(logp_s, logp_t, idx)
            total += (kl * w).sum()
            if teacher_grad is not None:  # before logp_s is overwritten below
                g_t = _kl_teacher_grad(logp_s, logp_t, idx, kl)
                teacher_grad[rows] = (g_t * (w * temperature)[:, None]).to(teacher_grad.dtype)
            if grad is not None:
                g = logp_s.exp_()  # softmax(s / T), reusing the buffer
                if idx is None:
                    g -= logp_t.exp()
                else:
                    g.scatter_add_(-1, idx, -logp_t.exp())
                g *= (w * temperature)[:, None]
                grad[rows] = g.to(grad.dtype)
        ctx.grad, ctx.teacher_grad = grad, teacher_grad
        return total * scale

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        return *consume_grads(ctx, grad_out), None, None, None, None


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
        ctx.grad, ctx.teacher_grad = grad, None  # `resolve_path` refuses a teacher needing grad
        return rows.sum()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        return *consume_grads(ctx, grad_out), None, None


def student_chunks(
    student: torch.Tensor, weights: torch.Tensor, temperature: float, chunk_size: int
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """Per chunk of `chunk_size` rows: the rows, their fp32 weights and student log-probs at T."""
    n = student.shape[0]
    for start in range(0, n, chunk_size):
        rows = slice(start, min(start + chunk_size, n))
        w = weights[rows].float()
        yield rows, w, F.log_softmax(student[rows].float() / temperature, dim=-1)


def consume_grads(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The student and teacher gradients saved by forward, scaled by `grad_out` in place.

    Kept as plain attributes (`ctx.grad`, `ctx.teacher_grad`), not `save_for_backward`, because
    they are modified in place and handed to autograd (no second (N, V) buffer); they are
    released here, so a second backward through the same graph fails loudly.
    """
    out: list[torch.Tensor | None] = []
    for i, name in enumerate(("grad", "teacher_grad")):
        grad: torch.Tensor | None = getattr(ctx, name)
        if grad is None and ctx.needs_input_grad[i]:
            raise RuntimeError(
                "the loss's saved gradient was consumed by an earlier backward: the memory-lean "
                "paths support one backward per forward (recompute the loss, or use "
                "chunk_size=None for retain_graph)"
            )
        setattr(ctx, name, None)
        out.append(None if grad is None else grad.mul_(grad_out.to(grad.dtype)))
    return tuple(out)


def resolve_path(
    backend: str, teacher: torch.Tensor | TopK, device: torch.device, chunk_size: int | None
) -> str:
    """`"plain"` (autograd reference), `"torch"` (chunked) or `"triton"`, with the checks."""
    if chunk_size is None:
        if backend == "triton":
            raise ValueError(
                "`chunk_size` None selects the plain autograd reference, which conflicts with "
                "`backend` 'triton': pass an int chunk size (ignored by the kernel) or "
                "backend='torch'"
            )
        _resolve_backend(backend, teacher, device)  # checks `backend`
        return "plain"
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"`chunk_size` ({chunk_size!r}) must be an int >= 1 or None")
    return _resolve_backend(backend, teacher, device)


def _resolve_backend(backend: str, teacher: torch.Tensor | TopK, device: torch.device) -> str:
    """`"torch"` or `"triton"` for `backend`, the teacher's form and `device`."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"`backend` ({backend!r}) must be 'auto', 'torch' or 'triton'")
    if backend == "torch":
        return backend
    from prune_distill import _kl_kernels

    dense = not isinstance(teacher, tuple)
    values = teacher[0] if isinstance(teacher, tuple) else teacher
    teacher_grad = torch.is_grad_enabled() and values.requires_grad
    if backend == "auto":
        fused = dense and device.type == "cuda" and _kl_kernels.HAS_TRITON and not teacher_grad
        return "triton" if fused else "torch"
    if teacher_grad:
        raise ValueError(
            "`teacher` requires grad, but backend 'triton' computes the student's gradient only: "
            "detach the teacher logits, or use backend='torch' (the chunked path computes both) "
            "or 'auto'"
        )
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


def check_vocab(teacher_vocab: int, student_vocab: int) -> None:
    """Raise a ValueError naming both sizes unless the teacher's vocabulary is the student's."""
    if teacher_vocab != student_vocab:
        raise ValueError(
            f"teacher vocab ({teacher_vocab}) != student vocab ({student_vocab}): distillation "
            "needs the same tokenizer and vocabulary size"
        )


def check_topk(values: torch.Tensor, indices: torch.Tensor, vocab: int) -> None:
    """Raise a ValueError naming `teacher` unless ``(values, indices)`` fit a `vocab`-id student.

    Both must have the same shape (..., k) and the indices an integer dtype; indices on the CPU
    must also lie in ``[0, vocab)``. On an accelerator that range check would read a value back
    to the host on every call (a sync in the training step), so it is left out there: `distill`
    compares the teacher's vocabulary size instead, and an out-of-range index fails in
    ``gather`` (a device-side assert on CUDA).
    """
    if values.shape != indices.shape:
        raise ValueError(
            f"`teacher` top-k values have shape {tuple(values.shape)} but its indices "
            f"{tuple(indices.shape)}: pass (values, indices) of the same shape (..., k), e.g. "
            "torch.topk(teacher_logits, k)"
        )
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise ValueError(
            f"`teacher` top-k indices have dtype {indices.dtype}: they must be integer ids "
            "into the student's vocabulary"
        )
    if indices.device.type != "cpu" or indices.numel() == 0:
        return
    if torch.compiler.is_compiling() or is_fake(indices):  # no values to read (a plan, a trace)
        return
    low, high = (int(x) for x in torch.aminmax(indices))
    if low < 0 or high >= vocab:
        raise ValueError(
            f"`teacher` top-k indices span [{low}, {high}] but the student vocab has {vocab} ids "
            f"(0 to {vocab - 1}): distillation needs the same tokenizer and vocabulary size"
        )


def flatten_inputs(
    student_logits: torch.Tensor, teacher: torch.Tensor | TopK, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | TopK, torch.Tensor]:
    """Token rows: student (N, V), teacher (N, V) or top-k (N, k) pair, row weights (N,).

    The weights are ``mask / number of valid tokens`` (``1 / N`` without a mask). Raises a
    ValueError naming the mismatch for a teacher of another vocabulary or shape (a top-k teacher:
    see `check_topk`), or a `mask` whose shape is neither the logits' leading shape nor (N,).
    """
    vocab = student_logits.shape[-1]
    s = student_logits.reshape(-1, vocab)
    if isinstance(teacher, tuple):
        values, indices = teacher
        check_topk(values, indices, vocab)
        k = values.shape[-1]
        t: torch.Tensor | TopK = (values.reshape(-1, k), indices.reshape(-1, k).long())
        lead = values.shape[:-1]
    else:
        check_vocab(teacher.shape[-1], vocab)
        t = teacher.reshape(-1, vocab)
        lead = teacher.shape[:-1]
    expected = tuple(student_logits.shape[:-1])
    if lead != student_logits.shape[:-1]:
        raise ValueError(f"teacher shape {tuple(lead)} != student shape {expected}")
    if mask is None:
        weights = torch.full((s.shape[0],), 1.0 / max(s.shape[0], 1), device=s.device)
    else:
        flat = (s.shape[0],)
        if tuple(mask.shape) not in (expected, flat):
            also = "" if expected == flat else f" or {flat}, flat in the logits' row order"
            raise ValueError(
                f"`mask` has shape {tuple(mask.shape)} but the logits have {s.shape[0]} token "
                f"rows: expected shape {expected}{also} (one entry per row of logits, the same "
                "element count in another shape is refused; with shifted logits, shift the mask "
                "the same way)"
            )
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
            each (e.g. ``torch.topk(teacher_logits, k)``; integer indices into the student's
            vocab, their range checked where they are on the CPU: see `check_topk`).
        mask: (...) 1 for tokens that count, 0 for padding: the logits' leading shape, or (N,)
            for their N token rows flattened (another shape raises a ValueError, also one with
            the same number of elements, e.g. transposed); None counts every token.
        temperature: T, a finite number > 0; the loss is multiplied by T^2 so gradient scales
            match T = 1.
        chunk_size: token rows per chunk of the chunked PyTorch path; None uses plain autograd
            (the reference implementation, whatever `backend` says unless it is ``"triton"``,
            which then raises). The Triton kernel ignores it (it streams one row at a time).
        backend: ``"torch"`` (chunked / plain PyTorch), ``"triton"`` (the fused kernel: dense
            teacher, CUDA or ``TRITON_INTERPRET=1``) or ``"auto"`` (Triton for a dense teacher on
            CUDA when Triton is installed, else ``"torch"``).

    Returns:
        A scalar fp32 loss. Teacher tokens of probability 0 (``-inf`` logits, also where the
        student is ``-inf`` too) add 0. A teacher that requires grad gets its gradient on the
        plain and chunked paths.
    """
    _check_number("temperature", temperature, low=0.0, strict=True)  # DistillConfig's check
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
    values, indices = t if isinstance(t, tuple) else (t, None)
    out = _ChunkedKL.apply(s, values, indices, weights, temperature, chunk_size)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out
