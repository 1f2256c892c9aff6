"""Validation perplexity over fixed windows.

The validation token stream is cut into non-overlapping windows of `seq_len` tokens (the
ragged tail is dropped). Inside a window, token t is scored given tokens 0..t-1 of the same
window, so each window contributes `seq_len - 1` predictions and its first token is not scored.
Perplexity = exp(sum of negative log-likelihoods / number of scored tokens), in nats.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from leanlm.train.autocast import uncached_casts

if TYPE_CHECKING:
    from leanlm.stages.base import StageContext


@dataclass(frozen=True)
class EvalResult:
    """Validation loss (mean NLL per scored token, nats) and its perplexity."""

    loss: float
    perplexity: float
    tokens: int
    """Scored tokens (windows x (seq_len - 1))."""
    windows: int
    tokens_per_s: float
    """Tokens read per second of wall time (windows x seq_len / seconds)."""


def window_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL of windows, fp32.

    Args:
        logits: `(B, T, V)` model outputs.
        input_ids: `(B, T)` the windows.

    Returns:
        A scalar: the sum over the `B * (T - 1)` scored tokens.
    """
    pred = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(pred, input_ids[:, 1:].reshape(-1), reduction="sum")


@torch.no_grad()
def evaluate_perplexity(
    model: torch.nn.Module,
    windows: torch.Tensor,
    *,
    batch_size: int = 16,
    autocast: Callable[[], AbstractContextManager[object]] = nullcontext,
    lockstep: bool = False,
) -> EvalResult:
    """Perplexity of `model` on `windows` `(N, T)`; the windows are split across processes.

    With torch.distributed initialised, rank r scores windows r, r + W, ... and the sums are
    all-reduced, so every rank returns the same result as a single process would. `autocast`
    makes a fresh context manager for each forward pass (e.g. `accelerator.autocast`).
    With `lockstep` every rank runs as many forward passes as the rank with the most windows
    (one with none left runs an unscored window): FSDP2 gathers each layer from all ranks.
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = next(model.parameters()).device
    mine = windows[rank::world]
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (nll, scored tokens)
    start = time.perf_counter()
    passes = math.ceil(mine.shape[0] / batch_size)
    if lockstep:  # as many as the rank with the most windows (ranks differ by at most one)
        passes = math.ceil(math.ceil(windows.shape[0] / world) / batch_size)
    for i in range(0, passes * batch_size, batch_size):
        batch = mine[i : i + batch_size].to(device)
        if batch.shape[0] == 0:  # lockstep: a forward the others need; nothing to score
            with autocast(), uncached_casts():
                model(input_ids=windows[:1].to(device))
            continue
        with autocast(), uncached_casts():
            logits = model(input_ids=batch).logits
        totals[0] += window_nll(logits, batch).double()
        totals[1] += batch.shape[0] * (batch.shape[1] - 1)
    if world > 1:
        dist.all_reduce(totals)
    elapsed = time.perf_counter() - start
    model.train(was_training)
    nll, count = totals.tolist()
    loss = nll / count
    return EvalResult(
        loss=loss,
        perplexity=math.exp(loss),
        tokens=int(count),
        windows=int(windows.shape[0]),
        tokens_per_s=windows.numel() / max(elapsed, 1e-9),
    )


def evaluate_validation(
    ctx: StageContext, model: torch.nn.Module, *, batch_size: int
) -> EvalResult:
    """`evaluate_perplexity` of `model` on the run's validation windows, under its autocast."""
    windows = ctx.resources.validation_windows
    return evaluate_perplexity(
        model, windows, batch_size=batch_size, autocast=ctx.accelerator.autocast
    )


def causal_lm_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over the batch's predicted tokens."""
    loss: torch.Tensor = model(input_ids=input_ids, labels=input_ids).loss
    return loss
