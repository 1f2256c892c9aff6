# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""Fused forward-KL kernel: the loss and the student-logit gradient in one kernel, no (N, V) temps.

Per token row: ``KL_n = Σ_v p_v (b_v - a_v) + lse(a) - lse(b)`` with ``a = s_n / T``,
``b = t_n / T``, ``p = softmax(b)``; ``loss_n = T² · w_n · KL_n``, ``grad_n = w_n · T · (q - p)``
(Hinton et al.'s KD loss, arXiv 1503.02531, in Minitron's forward-KL form, arXiv 2407.14679).
As Liger-Kernel's KL loss (arXiv 2410.10989), one program per row streams the vocabulary in
``BLOCK_V`` chunks, so only the gradient (N, V) and the loss (N,) are allocated.
`fused_kl_reference` is the tests' PyTorch statement of the contract; the CPU path is `losses.py`.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
# Vocabulary chunk per loop iteration. The interpreter pays per operation, not per element, but
# tests want several blocks and the tail of a non-multiple vocabulary exercised: a small block.
BLOCK_V_MAX = 512 if _INTERPRET else 4096
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available(device: torch.device) -> bool:
    """Whether the kernel can run on `device` (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        return False
    return device.type == "cuda" or (_INTERPRET and device.type == "cpu")


if HAS_TRITON:
    import triton
    import triton.language as tl

    LOWEST = tl.constexpr(-3.4028234663852886e38)
    """The lowest finite fp32: where a running max starts, so that a block of ``-inf`` logits
    (masked ids) shifts by a finite number (``exp(-inf - -inf)`` would be nan)."""
    LOG_ZERO = tl.constexpr(-1e30)
    """A finite stand-in for the log of a probability 0 (``-inf``): every real log-probability is
    above it, ``exp`` of it is 0, and differences with it stay finite, so ``0 · log 0`` is 0."""

    @triton.jit
    def online_lse(m, d, x):  # type: ignore[no-untyped-def]
        """One block `x` (padding lanes ``-inf``) of an online log-sum-exp: max `m`, Σexp `d`.

        Milakov & Gimelshein's update of the running max `m` and ``d = Σ exp(x - m)``. Returns
        ``(new max, new Σexp, rescale factor exp(m - new max), exp(x - new max))``; the caller
        rescales its own running sums by the factor. The running max starts at `LOWEST`, not
        ``-inf``, so it stays finite through blocks of ``-inf`` logits (masked ids, or padding),
        whose terms are then ``exp(-inf) = 0``.
        """
        new_m = tl.maximum(m, tl.max(x, axis=0))
        alpha = tl.exp(m - new_m)
        e = tl.exp(x - new_m)
        return new_m, d * alpha + tl.sum(e, axis=0), alpha, e

    @triton.jit
    def row_starts(s_ptr, t_ptr, stride_s, stride_t):  # type: ignore[no-untyped-def]
        """`(row, s_row, t_row)`: this program's row (int64) and its student and teacher rows."""
        row = tl.program_id(0).to(tl.int64)
        return row, s_ptr + row * stride_s, t_ptr + row * stride_t

    @triton.jit  # type: ignore[untyped-decorator]
    def scaled_block(s_row, t_row, start, n_cols, inv_temp, BLOCK_V: tl.constexpr):  # type: ignore[no-untyped-def]
        """`(cols, valid, a, b)`: the block at `start` of both rows in fp32, times ``1/T``.

        Padding lanes (``cols >= n_cols``) read 0 and are not `valid`.
        """
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < n_cols
        a = tl.load(s_row + cols, mask=valid, other=0.0).to(tl.float32) * inv_temp
        b = tl.load(t_row + cols, mask=valid, other=0.0).to(tl.float32) * inv_temp
        return cols, valid, a, b

    @triton.jit  # type: ignore[untyped-decorator]
    def kl_sweep(x_row, y_row, n_cols, inv_temp, BLOCK_V: tl.constexpr):  # type: ignore[no-untyped-def]
        """``(lse(x), lse(y), E[x - y])`` of rows ``x``, ``y`` times ``1/T``, E under softmax(x).

        ``KL(softmax(x) || softmax(y)) = E[x - y] - lse(x) + lse(y)``, from one read of both rows:
        online (max, Σexp) of each and ``acc = Σ exp(x - m_x)(x - y)`` rescaled with ``x``'s
        running max (``E[x - y] = acc / Σexp_x``). Sums are fp32 in vocabulary order; exponents
        are of ``x - running max <= 0``, so ±1e4 logits cannot overflow. A lane where
        ``exp(x - m_x)`` is 0 (padding, or a ``-inf`` logit of ``x``) adds ``0 · log 0 = 0``: it
        is dropped with `tl.where`, since ``x - y`` there may be ``-inf`` or nan.
        """
        m_x = LOWEST  # running max of x
        d_x = 0.0  # Σ exp(x - m_x)
        m_y = LOWEST
        d_y = 0.0
        acc = 0.0  # Σ exp(x - m_x) · (x - y)
        for start in range(0, n_cols, BLOCK_V):
            _, valid, x, y = scaled_block(x_row, y_row, start, n_cols, inv_temp, BLOCK_V)
            m_x, d_x, alpha, e_x = online_lse(m_x, d_x, tl.where(valid, x, float("-inf")))
            # e_x used at once: fewer registers
            acc = acc * alpha + tl.sum(tl.where(e_x > 0.0, e_x * (x - y), 0.0), axis=0)
            m_y, d_y, _, _ = online_lse(m_y, d_y, tl.where(valid, y, float("-inf")))
        lse_x = m_x + tl.log(d_x)
        lse_y = m_y + tl.log(d_y)
        return lse_x, lse_y, acc / d_x

    @triton.jit  # type: ignore[untyped-decorator]
    def _kl_kernel(  # type: ignore[no-untyped-def]
        s_ptr, t_ptr, w_ptr, grad_ptr, loss_ptr, n_cols, stride_s, stride_t, stride_g, inv_temp,
        temp, REVERSE: tl.constexpr, HAS_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        """Row ``pid``: ``loss = T²·w·KL(p || q)``, or ``T²·w·KL(q || p)`` when `REVERSE`.

        ``p = softmax(t/T)`` (teacher), ``q = softmax(s/T)`` (student). Sweep 1 is `kl_sweep`,
        teacher first for the forward KL, student first for the reverse (MiniLLM's); sweep 2
        (only with a gradient) re-reads both rows and writes the student gradient in the
        logits' dtype: ``w·T·(q - p)``, or ``w·T·q·(log q - log p - KL)`` when `REVERSE`
        (0 where ``q = 0``: the log-probabilities are floored at `LOG_ZERO`, since a ``-inf``
        student logit would make ``log q - log p`` nan).
        """
        row, s_row, t_row = row_starts(s_ptr, t_ptr, stride_s, stride_t)
        if REVERSE:
            lse_s, lse_t, e_diff = kl_sweep(s_row, t_row, n_cols, inv_temp, BLOCK_V)
            kl = e_diff - lse_s + lse_t
        else:
            lse_t, lse_s, e_diff = kl_sweep(t_row, s_row, n_cols, inv_temp, BLOCK_V)
            kl = e_diff + lse_s - lse_t
        w = tl.load(w_ptr + row).to(tl.float32)
        tl.store(loss_ptr + row, kl * w * temp * temp)
        if HAS_GRAD:
            g_row = grad_ptr + row * stride_g
            scale = w * temp
            for start in range(0, n_cols, BLOCK_V):
                cols, valid, a, b = scaled_block(s_row, t_row, start, n_cols, inv_temp, BLOCK_V)
                log_q = a - lse_s
                if REVERSE:  # q = 0 lanes: finite log terms (LOG_ZERO), so 0 · (...) = 0
                    log_q = tl.maximum(log_q, LOG_ZERO)
                    log_p = tl.maximum(b - lse_t, LOG_ZERO)
                    g = tl.exp(log_q) * (log_q - log_p - kl) * scale
                else:
                    g = (tl.exp(log_q) - tl.exp(b - lse_t)) * scale
                tl.store(g_row + cols, g.to(grad_ptr.dtype.element_ty), mask=valid)


# ---------------------------------------------------------------------------------- reference
def fused_kl_reference(
    student: Tensor, teacher: Tensor, weights: Tensor, temperature: float, *, need_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """PyTorch statement of `fused_kl`'s contract: per-row weighted loss (N,) fp32, grad (N, V).

    Materialises fp32 (N, V) temporaries; for tests and small inputs only.
    """
    logp_s = F.log_softmax(student.float() / temperature, dim=-1)
    logp_t = F.log_softmax(teacher.float() / temperature, dim=-1)
    w = weights.float()
    p = logp_t.exp()
    kl = (p * torch.where(p > 0, logp_t - logp_s, 0.0)).sum(-1)  # 0 log 0 = 0
    loss = kl * w * temperature * temperature
    if not need_grad:
        return loss, None
    grad = (logp_s.exp() - logp_t.exp()) * (w * temperature)[:, None]
    return loss, grad.to(student.dtype)


# ---------------------------------------------------------------------------------- launcher
def block_and_warps(n_cols: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) the launcher uses for a vocabulary of `n_cols`."""
    block = min(BLOCK_V_MAX, max(16, 1 << max(n_cols - 1, 0).bit_length()))
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    return block, warps


if HAS_TRITON:

    def gpu_launch_configs() -> list[dict[str, Any]]:
        """Every launch `fused_kl` makes on a GPU (for tools/gpu_compile.py).

        fp32/bf16/fp16 student and teacher logits (any pair), with and without the gradient,
        at a 1000-word vocabulary (one 1024-wide block, 4 warps; not a multiple of 16, so the
        loads are unaligned) and at Llama-3's 128256 (4096-wide blocks, 8 warps; aligned).
        """
        launches: list[dict[str, Any]] = []
        for s_dtype in DTYPES:
            for t_dtype in DTYPES:
                for vocab in (1000, 128256):
                    block, warps = block_and_warps(vocab)
                    for grad in (False, True):
                        args = {"s_ptr": s_dtype, "t_ptr": t_dtype, "w_ptr": torch.float32,
                                "grad_ptr": s_dtype if grad else torch.float32,
                                "loss_ptr": torch.float32, "n_cols": vocab, "stride_s": vocab,
                                "stride_t": vocab, "stride_g": vocab, "inv_temp": 0.5,
                                "temp": 2.0, "REVERSE": False, "HAS_GRAD": grad,
                                "BLOCK_V": block}  # fmt: skip
                        launches.append({"kernel": _kl_kernel, "args": args,
                                         "options": {"num_warps": warps}})  # fmt: skip
        return launches


def check_inputs(student: Tensor, teacher: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """Validate a fused loss's inputs; `(student, teacher)` with unit stride along V.

    `launch` checks every fused loss's inputs with it; raises as `fused_kl` documents.
    """
    if not available(student.device):
        raise ValueError(
            f"the Triton KL kernel needs triton and a CUDA device (or TRITON_INTERPRET=1 on "
            f"CPU); got {student.device}"
        )
    if student.dim() != 2 or teacher.shape != student.shape:
        raise ValueError(
            f"`student` and `teacher` must both be (N, V); got {tuple(student.shape)} and "
            f"{tuple(teacher.shape)}"
        )
    for name, x in (("student", student), ("teacher", teacher)):
        if x.dtype not in DTYPES:
            raise TypeError(f"`{name}` dtype {x.dtype} must be float32, bfloat16 or float16")
        if x.device != student.device:
            raise ValueError(f"`{name}` is on {x.device} but `student` on {student.device}")
    if weights.shape != (student.shape[0],) or weights.device != student.device:
        raise ValueError(
            f"`weights` must be ({student.shape[0]},) on {student.device}; got "
            f"{tuple(weights.shape)} on {weights.device}"
        )
    # unit stride along the vocabulary; a copy only for an exotic layout
    s = student if student.stride(-1) == 1 else student.contiguous()
    t = teacher if teacher.stride(-1) == 1 else teacher.contiguous()
    return s, t


def fused_kl(
    student: Tensor, teacher: Tensor, weights: Tensor, temperature: float, *, need_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """Per-row weighted forward KL (N,) fp32 and, if `need_grad`, its gradient w.r.t. `student`.

    Args:
        student: (N, V) fp32/bf16/fp16 student logits, unit stride along V (rows may be strided).
        teacher: (N, V) teacher logits of any of those dtypes, on the same device.
        weights: (N,) row weights (fp32); the loss is ``Σ_n out[n]``.
        temperature: T > 0.
        need_grad: also write ``w_n·T·(softmax(s_n/T) - softmax(t_n/T))`` in `student`'s dtype.

    Returns:
        ``(loss_rows, grad)`` with ``loss_rows[n] = T²·w_n·KL_n`` and grad None unless asked.

    Raises:
        ValueError: for shapes, devices or strides the kernel cannot take, or no Triton backend.
        TypeError: for a dtype other than fp32/bf16/fp16.
    """
    kernel = _kl_kernel if HAS_TRITON else None
    return launch(
        kernel, student, teacher, weights, temperature, need_grad=need_grad, REVERSE=False
    )


def launch(
    kernel: Any,
    student: Tensor,
    teacher: Tensor,
    weights: Tensor,
    temperature: float,
    *extra: float,
    need_grad: bool,
    **meta: bool,
) -> tuple[Tensor, Tensor | None]:
    """Check the inputs, allocate ``(loss_rows, grad)`` and run `kernel` one program per row.

    The launcher of every fused loss here and in `_divergence_kernels`: their kernels take the
    same leading arguments, then `extra` (JSD's β terms), then their constexpr flags (`meta`,
    e.g. ``REVERSE``), ``HAS_GRAD`` and ``BLOCK_V``.
    """
    s, t = check_inputs(student, teacher, weights)
    n, v = s.shape
    loss = torch.zeros(n, dtype=torch.float32, device=s.device)
    grad = torch.empty((n, v), dtype=s.dtype, device=s.device) if need_grad else None
    if n == 0 or v == 0:
        return loss, None if grad is None else grad.zero_()
    block, warps = block_and_warps(v)
    kernel[(n,)](
        s, t, weights.float().contiguous(), grad if grad is not None else loss, loss,
        v, s.stride(0), t.stride(0), v, 1.0 / temperature, float(temperature), *extra,
        **meta, HAS_GRAD=need_grad, BLOCK_V=block, num_warps=warps,
    )  # fmt: skip
    return loss, grad
