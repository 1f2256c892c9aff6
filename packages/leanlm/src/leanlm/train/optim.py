"""Optimizers a training stage can use, built from its config section."""

from __future__ import annotations

import typing
from collections.abc import Iterable
from typing import Any

import torch

from leanlm.config import OptimizerName

OPTIMIZERS: tuple[str, ...] = typing.get_args(OptimizerName)
"""The names `OptimizerName` allows, in its order."""


def decay_param_groups(params: Iterable[torch.Tensor], weight_decay: float) -> list[dict[str, Any]]:
    """Matrices (decayed) and vectors such as norm weights (not decayed); empty groups dropped.

    Works on a model's parameters and on shard-zero's row shards alike (a row shard of a matrix
    is still 2-D).
    """
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _all_on_cpu(params: list[Any]) -> bool:
    """Every tensor of `params` (tensors or param-group dicts) is a floating CPU tensor."""
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    return bool(tensors) and all(t.device.type == "cpu" and t.is_floating_point() for t in tensors)


def optimizer_over(
    name: OptimizerName,
    params: list[Any],
    *,
    lr: float,
    betas: tuple[float, float],
    state_dtype: str = "fp32",
) -> torch.optim.Optimizer:
    """The optimizer `name` over `params` (tensors or param-group dicts).

    The learning rate is driven from outside (warmup + cosine scheduler), so Adafactor runs with
    an explicit `lr` and without its relative step and parameter-scale heuristics (HF's
    recommended settings for an external schedule). CAME uses `betas[0]` as its β1 with its
    default β2 = 0.999 and β3 = 0.9999, and `instability_init=1.0` (no early update spike; see
    the optim-came README), and keeps its first moment in `state_dtype` ("fp32", "bf16" or
    "int8"); Adafactor takes "int8" too, for a momentum with β1 = `betas[0]` in 8 bits (else
    no momentum); AdamW takes only "fp32" and uses `betas` as given, fused (torch's one-kernel
    step) when every parameter is on the CPU.

    Raises:
        ValueError: for an unknown `name`.
    """
    groups = params
    if name == "came":
        from optim_came import CAME

        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[state_dtype]
        return CAME(
            groups, lr=lr, betas=(betas[0], 0.999, 0.9999), instability_init=1.0, state_dtype=dtype
        )
    if name == "adamw":
        # torch's fused CPU kernel: 7-9x its default for-loop step (shard-zero's
        # benchmarks/RESULTS.md §4), what a CPU run and ZeRO-Offload's host step run
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=_all_on_cpu(groups) or None)
    if name == "adafactor":
        from optim_adafactor import Adafactor

        int8 = state_dtype == "int8"  # a momentum (β1 = betas[0]) in 8 bits
        return Adafactor(
            groups, lr=lr, relative_step=False, scale_parameter=False, warmup_init=False,
            beta1=betas[0] if int8 else None, state_dtype=torch.int8 if int8 else torch.float32,
        )  # fmt: skip
    raise ValueError(f"`optimizer` ({name!r}) must be one of {list(OPTIMIZERS)}")
