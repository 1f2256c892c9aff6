"""Validation of CAME's constructor and param-group options.

Host-side Python on floats and ints only: nothing here touches a tensor, so nothing here can
synchronise with the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from optim_adafactor.checks import (
    STEP,
    GroupCheck,
    Scalar,
    check_bool,
    check_lr,
    check_non_negative,
    check_number,
)

STATE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


def _check_pair(name: str, value: object, length: int) -> tuple[Any, ...]:
    if not isinstance(value, tuple | list) or len(value) != length:
        raise TypeError(f"`{name}` must be a tuple of {length} numbers, got {value!r}")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class GroupOptions:
    """The validated options of one param group."""

    lr: Scalar
    eps1: float
    eps2: float
    clip_threshold: float
    beta1: float
    beta2: float
    beta3: float
    weight_decay: float
    bias_correction: bool
    instability_init: float
    state_dtype: torch.dtype
    stochastic_rounding: bool

    def second_moment_correction(self, step: int) -> float:
        """`1 - β2^t` with `bias_correction`, else 1 (came-pytorch has none)."""
        return 1.0 - self.beta2**step if self.bias_correction else 1.0

    def instability_correction(self, step: int) -> float:
        """`1 - β3^t` with `bias_correction` and zero-initialised instability, else 1.

        With a non-zero `instability_init` the EMA is not biased towards zero, so it is not
        corrected.
        """
        if self.bias_correction and self.instability_init == 0.0:
            return 1.0 - self.beta3**step
        return 1.0


def parse_group(group: Mapping[str, Any], check: GroupCheck = STEP) -> GroupOptions:
    """Validate one param group; raise `ValueError`/`TypeError` naming the argument and value.

    `check.first` (construction, `add_param_group`) also checks a tensor `lr`'s value (a host
    read); in the constructor's defaults (`check.defaults`) `lr` may be None when every param
    group gives one.
    """
    lr = group["lr"]
    if lr is not None:
        lr = check_lr(lr, check_value=check.first)
    elif check.defaults:
        lr = 0.0  # unused: every param group gives its own, checked as the group is added
    else:
        raise TypeError(
            "`lr` is required (CAME has no default learning rate): give it to the constructor "
            "or to every param group, got None"
        )

    eps1, eps2 = _check_pair("eps", group["eps"], 2)
    eps1 = check_number("eps[0]", eps1)
    eps2 = check_number("eps[1]", eps2)
    if eps1 < 0:
        raise ValueError(f"`eps[0]` ({eps1}) must be >= 0")
    if eps2 < 0:
        raise ValueError(f"`eps[1]` ({eps2}) must be >= 0")

    clip = check_number("clip_threshold", group["clip_threshold"])
    if clip <= 0:
        raise ValueError(f"`clip_threshold` ({clip}) must be > 0")

    betas = _check_pair("betas", group["betas"], 3)
    checked = []
    for i, beta in enumerate(betas):
        b = check_number(f"betas[{i}]", beta)
        if not 0.0 <= b < 1.0:
            raise ValueError(f"`betas[{i}]` ({b}) must be in [0, 1)")
        checked.append(b)

    weight_decay = check_non_negative("weight_decay", group["weight_decay"])
    instability_init = check_non_negative("instability_init", group["instability_init"])

    state_dtype = group["state_dtype"]
    if state_dtype not in STATE_DTYPES:
        raise TypeError(
            f"`state_dtype` ({state_dtype!r}) must be torch.float32, torch.bfloat16 or torch.int8 "
            "(the storage of the first moment `exp_avg`; int8: blockwise 8-bit codes with fp32 "
            "scales; the factored statistics are always fp32)"
        )

    return GroupOptions(
        lr=lr,
        eps1=eps1,
        eps2=eps2,
        clip_threshold=clip,
        beta1=checked[0],
        beta2=checked[1],
        beta3=checked[2],
        weight_decay=weight_decay,
        bias_correction=check_bool("bias_correction", group["bias_correction"]),
        instability_init=instability_init,
        state_dtype=state_dtype,
        stochastic_rounding=check_bool("stochastic_rounding", group["stochastic_rounding"]),
    )
