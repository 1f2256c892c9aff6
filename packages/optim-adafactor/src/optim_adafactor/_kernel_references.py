"""Pure-PyTorch references of the per-tensor Adafactor kernels in `_kernels`.

One per kernel, on the same (B, n, m) views: `stats_reference` (`_stats_kernel`: row sums and
the same row-block partials), `sumsq_reference` (`_sumsq_kernel`, summed) and `apply_reference`
(`_apply_kernel`). The kernel tests compare against them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from optim_adafactor._kernels import BLOCK_N


def stats_reference(g: Tensor, p: Tensor | None, block_n: int = BLOCK_N) -> tuple[Tensor, ...]:
    """Reference of `_stats_kernel` on (B, n, m): row sums, (B, blocks, m) partials, Σp² parts."""
    g2 = g.float().square()
    b, n, m = g2.shape
    blocks = -(-n // block_n)
    pad = blocks * block_n - n
    padded = torch.nn.functional.pad(g2, (0, 0, 0, pad))
    colpart = padded.view(b, blocks, block_n, m).sum(dim=2)
    ppart = None
    if p is not None:
        p2 = torch.nn.functional.pad(p.float().square(), (0, 0, 0, pad))
        ppart = p2.view(b, blocks, block_n * m).sum(dim=-1).reshape(-1)
    return g2.sum(dim=-1), colpart, *((ppart,) if ppart is not None else ())


def sumsq_reference(g: Tensor, rf: Tensor, cf: Tensor) -> Tensor:
    """Reference of `_sumsq_kernel`, summed: Σ (g · rf ⊗ cf)²."""
    return (g.float() * rf.unsqueeze(-1) * cf.unsqueeze(-2)).square().sum()


def apply_reference(  # noqa: PLR0917 (the kernel's operands, in its order)
    g: Tensor,
    p: Tensor,
    m: Tensor | None,
    rs: Tensor,
    cf: Tensor,
    decay: Tensor | None,
    beta1: float,
) -> None:
    """Reference of `_apply_kernel` (round-to-nearest store), in place on `p` and `m`.

    `decay` holds `weight_decay · lr_t` (shape (1,)) or is None.
    """
    upd = g.float() * rs.unsqueeze(-1) * cf.unsqueeze(-2)
    if m is not None:
        m.mul_(beta1).add_(upd)
        upd = m
    p32 = p.float()
    if decay is not None:
        p32 = p32 - decay * p32
    p.copy_(p32 - upd)
