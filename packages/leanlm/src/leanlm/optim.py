"""Optimizers a training stage can use, built from its config section."""

from __future__ import annotations

from typing import Any, Literal

import torch

OptimizerName = Literal["adamw", "adafactor"]
"""`adamw`: `torch.optim.AdamW`; `adafactor`: `optim_adafactor.Adafactor` (factored second
moments: O(rows + cols) state per matrix instead of AdamW's two full-size buffers)."""


def decay_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: matrices (decayed) and vectors such as norm weights (not decayed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def build_optimizer(
    name: OptimizerName,
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
) -> torch.optim.Optimizer:
    """The optimizer `name` over `model`'s trainable parameters.

    The learning rate is driven from outside (warmup + cosine scheduler), so Adafactor runs with
    an explicit `lr` and without its relative step and parameter-scale heuristics (HF's
    recommended settings for an external schedule). `betas` apply to AdamW only.

    Raises:
        ValueError: for an unknown `name`.
    """
    groups = decay_param_groups(model, weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas)
    if name == "adafactor":
        from optim_adafactor import Adafactor

        return Adafactor(
            groups, lr=lr, relative_step=False, scale_parameter=False, warmup_init=False
        )
    raise ValueError(f"`optimizer` ({name!r}) must be one of ['adamw', 'adafactor']")
