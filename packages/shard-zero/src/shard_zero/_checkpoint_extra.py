"""Checkpoint contents besides parameter and state tensors.

The optimizer's extra state-dict entries, and the model's persistent buffers (by key).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def optimizer_extra(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state-dict entries besides `state` and `param_groups`.

    E.g. optim-came's and optim-adafactor's stochastic-rounding seed, which a resume needs to
    continue exactly. Only plain values (numbers, strings, tensors, lists and dicts of them),
    which `torch.load(weights_only=True)` reads back; anything else is not saved.
    """
    whole = optimizer.state_dict()
    return {k: v for k, v in whole.items() if k not in ("state", "param_groups") and _plain(v)}


def _plain(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str | int) and _plain(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str | torch.Tensor)


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers `model.state_dict()` holds, by key (non-persistent ones are rebuilt)."""
    buffers = {}
    for prefix, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                buffers[f"{prefix}.{name}" if prefix else name] = buffer
    return buffers


def load_optimizer_extra(optimizer: torch.optim.Optimizer, extra: dict[str, Any] | None) -> None:
    """Give `optimizer` the entries `optimizer_extra` saved, through its own `load_state_dict`.

    It loads them with an empty state and its current param groups, so call it before filling
    the state (a plain torch optimizer saves none: nothing is called). The optimizer keeps its
    `state` and `param_groups` objects (torch's loader makes new ones), which `ZeroOptimizer`
    and LR schedulers hold.
    """
    if not extra:
        return
    state, groups = optimizer.state, optimizer.param_groups
    saved_groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": {}, "param_groups": saved_groups, **extra})
    for group, loaded in zip(groups, optimizer.param_groups, strict=True):
        group.update(loaded)  # the same values, the same Parameter objects
    optimizer.state, optimizer.param_groups = state, groups
