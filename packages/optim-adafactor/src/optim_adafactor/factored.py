"""Public building blocks of factored second-moment optimizers (Adafactor, and optim-came's CAME).

For a tensor viewed as (..., n, m) and a non-negative statistic `x` (g², or CAME's instability),
the factored second moment keeps row and column EMAs `r`, `c` (`ema_`) and approximates
`x_ij^-1/2 ≈ rf_i · cf_j` with `rf = rsqrt(r / mean(r))`, `cf = rsqrt(c)` (`factors`); under row
sharding the caller all-reduces the column sums and `Σ_i r_i` first. Also the Triton launchers
of the two statistics passes (`sq_stats`, `scaled_sumsq`) and JIT helpers for other packages'
kernels: they need Triton and CUDA, or `TRITON_INTERPRET=1` (check `triton_available`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from optim_adafactor import _jit_helpers, _kernels
from optim_adafactor._stochastic import copy_stochastic_

__all__ = [
    "BLOCK_N",
    "add_scaled_",
    "as_3d",
    "chunk",
    "chunk_shape",
    "compile_safe_scalars",
    "copy_stochastic_",
    "ema_",
    "factored_sumsq",
    "factors",
    "gsq_stats",
    "planned",
    "row_chunks",
    "scaled_sumsq",
    "sq_stats",
    "triton_available",
]

#: Rows per program of the Triton statistics kernels (the row-block partial sums are per BLOCK_N).
BLOCK_N = _kernels.BLOCK_N

if _kernels.HAS_TRITON:
    #: `@triton.jit` helper: `stochastic_round_bf16(x_fp32, seed, counters)` returns fp32 values
    #: exactly representable in bf16, rounded up with probability equal to the discarded fraction
    #: (unbiased). Call it from another kernel just before a bf16 store; `counters` (one Philox
    #: draw per 8 columns) come from `sr_counters(rows, start, n_cols, BLOCK_M)`.
    stochastic_round_bf16 = _jit_helpers.stochastic_round_bf16
    sr_counters = _jit_helpers.sr_counters
    #: `@triton.jit` helper: `store_update(p_ptr, offs, mask, p, upd, wd_lr, seed, counters,
    #: HAS_DECAY, SR)` writes `p - wd_lr·p - upd` (fp32 math) in p's dtype, stochastically
    #: rounded with SR.
    store_update = _jit_helpers.store_update
    #: `@triton.jit` helper: `tensor_seed(seed_base, index)`, the rounding seed of a step's
    #: `index`-th tensor (`FactoredOptimizer._kernel_seed`).
    tensor_seed = _jit_helpers.tensor_seed
    #: `@triton.jit` helpers of the per-tensor kernels' (batch, row-block) grid:
    #: `row_tile(n_rows, n_cols, BLOCK_N)` -> `(pid_b, pid_r, rows, row_mask, base)` and
    #: `col_tile(start, rows, row_mask, base, n_cols, BLOCK_M)` -> `(cols, col_mask, mask, offs)`.
    row_tile = _jit_helpers.row_tile
    col_tile = _jit_helpers.col_tile
    __all__ += ["col_tile", "row_tile", "stochastic_round_bf16", "store_update", "tensor_seed"]
    __all__ += ["sr_counters"]


def ema_(avg: Tensor, mean: Tensor, beta: float, eps: float) -> Tensor:
    """`avg ← β·avg + (1-β)·(mean + ε)` in place and return `avg`; `mean` is used as scratch.

    Eagerly `add_(mean + ε, alpha=1-β)`, the references' form (HF, came-pytorch: same bits).
    Inside `torch.compile` `(mean + ε)·(1-β)` is added instead (`compile_safe_scalars`).

    Args:
        avg: The running statistic (fp32), updated in place.
        mean: This step's mean of the statistic, same shape as `avg`; overwritten.
        beta: EMA coefficient in [0, 1).
        eps: Added to `mean` before the EMA (Adafactor's ε1, CAME's ε1 or ε2).
    """
    if compile_safe_scalars():
        return avg.mul_(beta).add_(mean.add_(eps).mul_(1.0 - beta))
    return avg.mul_(beta).add_(mean.add_(eps), alpha=1.0 - beta)


def add_scaled_(target: Tensor, x: Tensor, coef: Tensor | float) -> Tensor:
    """`target += coef · x` in place for a host float or a 0-dim device tensor `coef`.

    A tensor `coef` (a step size computed on the device) is used without a host sync. A float
    `coef` is `add_`'s `alpha` eagerly; inside `torch.compile` `x·coef` is added instead
    (`compile_safe_scalars`).
    """
    if isinstance(coef, Tensor):
        return target.addcmul_(x, coef)
    if compile_safe_scalars():
        return target.add_(x.mul(coef))
    return target.add_(x, alpha=coef)


def compile_safe_scalars() -> bool:
    """Whether a step-varying float must not be an op's `alpha=` (inside `torch.compile`).

    Under `torch.compile` a float that changes between steps (β2_t, a scheduled `lr`) is a
    symbolic float. Where it is used both as a tensor operand (`x.mul_(β)`) and as `alpha=`,
    torch 2.13's inductor keeps the `alpha` of an earlier call: the compiled `ema_` was 28% off
    at the third call (pytorch/pytorch#194976, #197889). So the compiled step multiplies
    instead: the same value but for one more fp32 rounding (of the product `alpha·x`). The eager
    step keeps the references' `alpha=` form bit for bit.
    """
    return torch.compiler.is_compiling()


def factors(row: Tensor, col: Tensor, row_mean: Tensor) -> tuple[Tensor, Tensor]:
    """The factored inverse square root: `rf = rsqrt(row / row_mean)` and `cf = rsqrt(col)`.

    Args:
        row: Row statistic, shape (..., n).
        col: Column statistic, shape (..., m).
        row_mean: Mean of `row` over the logical tensor's rows, shape (..., 1).

    Returns:
        `(rf, cf)` of shapes (..., n) and (..., m): `rsqrt(x_ij) ≈ rf_i · cf_j`.
    """
    return (row / row_mean).rsqrt_(), col.rsqrt()


#: Elements of one row chunk of the PyTorch path's sweeps on the CPU (4 MiB of fp32): the ~10-30
#: element-wise ops of a phase run on one chunk while it stays in the last-level cache (the best
#: of 2^17-2^21 on a 32 MiB-L3 EPYC at 1 and 2 threads, benchmarks/RESULTS.md).
CPU_CHUNK = 1 << 20


def row_chunks(t: Tensor) -> list[slice]:
    """Row ranges over which the PyTorch path sweeps a phase of a factored tensor `t` (..., n, m).

    A 2-D CPU tensor larger than `CPU_CHUNK` elements: consecutive ranges of whole rows of about
    `CPU_CHUNK` elements (fixed by the shape, so a step's result never depends on the machine);
    anything else: one range over all of it (`t[s]` is `t`).
    """
    n, m = t.shape[-2], t.shape[-1]
    if t.device.type != "cpu" or t.dim() != 2 or t.numel() <= CPU_CHUNK:
        return [slice(None)]
    step = max(1, CPU_CHUNK // m)
    return [slice(r, min(r + step, n)) for r in range(0, n, step)]


def chunk_shape(t: Tensor) -> torch.Size:
    """Shape of the largest of `row_chunks(t)`: what a workspace for one chunk of `t` holds."""
    chunks = row_chunks(t)
    if len(chunks) == 1:
        return t.shape
    return torch.Size((chunks[0].stop - chunks[0].start, t.shape[-1]))


def chunk(buf: Tensor, rows: slice) -> Tensor:
    """The part of a one-chunk workspace `buf` (`chunk_shape`) that the chunk `rows` uses."""
    return buf if rows == slice(None) else buf[: rows.stop - rows.start]


def gsq_stats(
    g: Tensor, buf: Tensor, row: Tensor, beta: float, eps: float
) -> tuple[Tensor, Tensor]:
    """Phase-1 statistics of a factored `g` (..., n, m), chunk by chunk of rows (`row_chunks`).

    Writes `g²` into `buf`, a one-chunk workspace (`chunk_shape`); updates the row EMA in place,
    `row = β·row + (1-β)·(mean_j g² + ε)`; returns the column sums of `g²` and of `g² / row`
    (..., m). With the latter `factored_sumsq` gives `Σ u²` without another pass over `g²`.
    """
    colsum = over_row = None
    for rows in row_chunks(g):
        b, r = torch.mul(g[rows], g[rows], out=chunk(buf, rows)), row[rows]
        ema_(r, b.sum(dim=-1).div_(g.shape[-1]), beta, eps)
        c, t = b.sum(dim=-2), torch.matmul(r.reciprocal().unsqueeze(-2), b).squeeze(-2)
        colsum = c if colsum is None else colsum.add_(c)
        over_row = t if over_row is None else over_row.add_(t)
    assert colsum is not None
    assert over_row is not None
    return colsum, over_row


def triton_available(device: torch.device) -> bool:
    """Whether the Triton launchers can run on `device` (CUDA, or CPU with TRITON_INTERPRET=1)."""
    return _kernels.available(device)


def planned(kernel: object, t3: Tensor, bytes_per_element: float) -> bool:
    """Record a per-tensor launch over (B, n, m) `t3` while a launch plan is made.

    Returns True while `optim_adafactor.multi_tensor.plan_launches` runs (do not launch then).
    """
    return _kernels.planned(kernel, t3, bytes_per_element)


def as_3d(t: Tensor) -> Tensor:
    """View a (..., n, m) tensor as (B, n, m) (a copy only if the leading dims do not flatten)."""
    return _kernels.as_3d(t)


def sq_stats(x3: Tensor) -> tuple[Tensor, Tensor]:
    """Row and column sums of `x²` for a contiguous (B, n, m) tensor, in one Triton pass.

    Accumulates in fp32 (bf16/fp16 inputs are upcast on load). Deterministic: the column sums
    are per-row-block partials summed in a fixed order, without atomics.

    Returns:
        `(rowsum, colsum)`: fp32 tensors of shapes (B, n) and (B, m).
    """
    rowsum, colpart, _ = _kernels.launch_stats(x3, None)
    return rowsum, colpart.sum(dim=1)


def factored_sumsq(over_row: Tensor, cf: Tensor, row_mean: Tensor) -> Tensor:
    """`Σ u²` of `u = g·rf⊗cf`, `rf = rsqrt(r / row_mean)`: `row_mean Σ_j cf_j² Σ_i g²_ij / r_i`.

    `over_row`: `gsq_stats`' column sums of `g² / r` (..., m) (of the local rows under row
    sharding: the result is then this shard's part); `cf` (..., m); `row_mean` (..., 1), the
    mean of the row EMA over all rows. `u` is never materialised, `g²` not read again.
    """
    return over_row.mul(cf.square()).mul_(row_mean).sum()


def scaled_sumsq(x3: Tensor, rf: Tensor, cf: Tensor) -> Tensor:
    """`Σ (x_bij · rf_bi · cf_bj)²` for a contiguous (B, n, m) `x3`, as a 0-dim fp32 tensor.

    Args:
        x3: (B, n, m) tensor (any float dtype; upcast on load).
        rf: (B, n) fp32 row factors.
        cf: (B, m) fp32 column factors.
    """
    return _kernels.launch_sumsq(x3, rf, cf)
