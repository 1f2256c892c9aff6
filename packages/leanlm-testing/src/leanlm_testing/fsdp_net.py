"""The small model and data shared by the FSDP2 parity runs (`fsdp`) and DCP chains (`fsdp_dcp`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

MakeOptimizer = Callable[[Iterable[Tensor]], torch.optim.Optimizer]

BATCH = 4  # examples per rank and step


class Net(nn.Module):
    """Linear(9→13) → tanh → Linear(13→7) → tanh → Linear(7→3, no bias), and a (5, 3, 4) tensor.

    Rows 13, 7, 3 and 5 are not multiples of 2 or 4 (3 rows on 4 ranks leave one rank empty);
    columns 9, 13 and 7 are odd.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(9, 13)
        self.lin2 = nn.Linear(13, 7)
        self.lin3 = nn.Linear(7, 3, bias=False)
        self.extra = nn.Parameter(torch.randn(5, 3, 4) * 0.5)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        """Mean squared error plus a term that gives `extra` element-wise varied gradients."""
        out = self.lin3(torch.tanh(self.lin2(torch.tanh(self.lin1(x)))))
        extra = (torch.sin(self.extra) * x.mean()).square().sum()
        loss: Tensor = (out - y).square().mean() + extra
        return loss


def batch(step: int, rank: int) -> tuple[Tensor, Tensor]:
    """Data rank `rank`'s `(x, y)` at `step`: `BATCH` examples, the same on every call."""
    gen = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(BATCH, 9, generator=gen) * torch.rand(9, generator=gen).add_(0.2)
    return x, torch.randn(BATCH, 3, generator=gen)


def full_value(p: Tensor) -> Tensor:
    """The full value of a (DTensor) parameter, gathered."""
    full = p.detach()
    if isinstance(full, DTensor):
        full = full.full_tensor()
    return full.clone()  # full_tensor() of a Replicate DTensor is its local tensor
