"""One parameter's step in flight (`StepWork`) and the helpers every phase module shares.

`StepWork` is the record `base.FactoredOptimizer` prepares for each parameter it steps and
that the PyTorch phases, the kernels' launchers and the sharded reductions read and fill;
`stat_dtype` is the dtype of the statistics and of the math, and `decay_` the decoupled
weight decay of both optimizers. `base` re-exports all three: import them from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from optim_adafactor.checks import Scalar
from optim_adafactor.factored import compile_safe_scalars
from optim_adafactor.sharding import RowShard


def stat_dtype(param: Tensor) -> torch.dtype:
    """Dtype of the statistics and of the math: float64 for float64 params, else fp32."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def decay_(p: Tensor, weight_decay: float, lr: Scalar) -> None:
    """`p ← p - weight_decay·lr·p` in the references' form (HF, came-pytorch).

    `p.add_(p, alpha=-wd·lr)` keeps the decay exact to fp32 rounding of the product; the form
    `p.mul_(1 - wd·lr)` rounds `1 - wd·lr` to fp32 (spacing 2^-24 below 1) and is off by up to
    0.3% near wd·lr = 1e-5, always in the same direction. A tensor `lr` stays on the device
    (no host sync). Inside `torch.compile` a float `lr` (which a scheduler changes every step)
    is not passed as `alpha` (`factored.compile_safe_scalars`): `p·(-wd·lr)` is added instead.
    """
    if isinstance(lr, Tensor):  # -wd·lr in float64, rounded once, as a float `alpha` is
        p.addcmul_(p, lr.to(torch.float64).mul(-weight_decay).to(p.dtype))
    elif compile_safe_scalars():
        p.add_(p.mul(-weight_decay * lr))
    else:
        p.add_(p, alpha=-weight_decay * lr)


@dataclass(slots=True, kw_only=True)
class StepWork:
    """One parameter's step in flight: inputs, resolved constants and shared phase results."""

    param: Tensor
    p32: Tensor  # the parameter itself, or a copy in the compute dtype (bf16/fp16 params)
    grad: Tensor  # compute-dtype gradient on the PyTorch path; the raw gradient when fused
    state: dict[str, Any]
    opts: Any
    step: int
    factored: bool
    shard: RowShard | None
    rows: int  # global size of dim -2 (the column-mean divisor) of factored tensors
    numel: int  # global number of elements
    index: int  # position in the step (seeds stochastic rounding)
    fused: bool = False  # the phases run as Triton kernels
    colsum: Tensor | None = None
    rowema_sum: Tensor | None = None
    rf: Tensor | None = None
    cf: Tensor | None = None
    gsq_over_row: Tensor | None = None  # column sums of g² / r (PyTorch path: gives Σ u²)
    # an int8 first moment (`quant`): stochastic-rounding seed of its codes, and workspaces of
    # the PyTorch path (dequantized values, signs, fp32 noise and int32 hash; None: allocate)
    quant_seed: int | None = None
    m_buf: Tensor | None = None
    sign_buf: Tensor | None = None
    noise_buf: Tensor | None = None
    hash_buf: Tensor | None = None

    @property
    def reduce_factors(self) -> bool:
        """Whether column sums and row-EMA sums are reduced over the shard group (2-D only).

        For >= 3-D tensors dim 0 is a batch dim, so the factored dims are local to a rank.
        """
        return self.shard is not None and self.factored and self.param.dim() == 2
