"""How activation statistics are reduced over the sequence and over the batch.

Minitron (arXiv 2407.14679, Table 11) compares reductions of per-token activation magnitudes:
first over each sample's non-padding tokens (``mean``, ``l2`` norm or population ``var``), then
over the samples (``l2``, ``mean`` or ``var``). It adopts (batch ``l2``, sequence ``mean``), the
default here; the others are options for its ablation. Samples with no non-padding token do not
count; accumulation is fp64.
"""

from __future__ import annotations

from typing import Literal

import torch

SeqAggregation = Literal["mean", "l2", "var"]
BatchAggregation = Literal["l2", "mean", "var"]
SEQ_CHOICES: tuple[str, ...] = ("mean", "l2", "var")
BATCH_CHOICES: tuple[str, ...] = ("l2", "mean", "var")


def check_aggregation(seq: str, batch: str) -> None:
    """Raise `ValueError` for an unknown reduction name."""
    if seq not in SEQ_CHOICES:
        raise ValueError(f"`seq_aggregation` ({seq!r}) must be one of {SEQ_CHOICES}")
    if batch not in BATCH_CHOICES:
        raise ValueError(f"`batch_aggregation` ({batch!r}) must be one of {BATCH_CHOICES}")


def reduce_seq(x: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """Reduce (B, S, ...) `x` over the sequence, counting only positions where `mask` is 1."""
    m = mask.to(torch.float64).reshape(*mask.shape, *([1] * (x.dim() - 2)))
    x = x.to(torch.float64)
    count = m.sum(dim=1).clamp_min(1.0)
    if how == "l2":
        return ((x * x) * m).sum(dim=1).sqrt()
    mean = (x * m).sum(dim=1) / count
    if how == "mean":
        return mean
    return (((x - mean.unsqueeze(1)) ** 2) * m).sum(dim=1) / count


class Aggregator:
    """Accumulates per-sample statistics of ``groups`` independent score tensors of one shape."""

    def __init__(
        self, groups: int, shape: tuple[int, ...], device: torch.device, seq: str, batch: str
    ) -> None:
        self.seq, self.batch = seq, batch
        self.s1 = torch.zeros(groups, *shape, dtype=torch.float64, device=device)
        self.s2 = torch.zeros_like(self.s1)
        self.rows = torch.zeros(groups, dtype=torch.float64, device=device)

    def add(self, group: int, x: torch.Tensor, mask: torch.Tensor) -> None:
        """Add a batch: `x` (B, S, *shape) non-negative magnitudes, `mask` (B, S)."""
        per_row = reduce_seq(x, mask, self.seq)  # (B, *shape)
        valid = (mask.sum(dim=1) > 0).to(torch.float64).reshape(-1, *([1] * (per_row.dim() - 1)))
        self.s1[group] += (per_row * valid).sum(0)
        self.s2[group] += (per_row * per_row * valid).sum(0)
        self.rows[group] += valid.sum()

    def result(self) -> torch.Tensor:
        """The (groups, *shape) scores, fp32."""
        n = self.rows.clamp_min(1.0).reshape(-1, *([1] * (self.s1.dim() - 1)))
        if self.batch == "l2":
            out = self.s2.sqrt()
        elif self.batch == "mean":
            out = self.s1 / n
        else:
            out = (self.s2 / n - (self.s1 / n) ** 2).clamp_min(0.0)
        return out.float()
