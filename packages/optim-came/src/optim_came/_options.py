"""Validation of CAME's constructor and param-group options.

Host-side Python on floats and ints only: nothing here touches a tensor, so nothing here can
synchronise with the device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

Backend = Literal["auto", "torch", "triton"]
BACKENDS: tuple[str, ...] = get_args(Backend)
STATE_DTYPES = (torch.float32, torch.bfloat16)


def _check_number(name: str, value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"`{name}` must be a real number, got {value!r} ({type(value).__name__})")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"`{name}` ({number}) must be finite")
    return number


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {value!r} ({type(value).__name__})")
    return value


def _check_pair(name: str, value: object, length: int) -> tuple[Any, ...]:
    if not isinstance(value, tuple | list) or len(value) != length:
        raise TypeError(f"`{name}` must be a tuple of {length} numbers, got {value!r}")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class GroupOptions:
    """The validated options of one param group."""

    lr: float
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


def parse_group(group: Mapping[str, Any]) -> GroupOptions:
    """Validate one param group; raise `ValueError`/`TypeError` naming the argument and value."""
    lr = group["lr"]
    if lr is None:
        raise TypeError("`lr` is required (CAME has no default learning rate), got None")
    lr = _check_number("lr", lr)
    if lr < 0:
        raise ValueError(f"`lr` ({lr}) must be >= 0")

    eps1, eps2 = _check_pair("eps", group["eps"], 2)
    eps1 = _check_number("eps[0]", eps1)
    eps2 = _check_number("eps[1]", eps2)
    if eps1 < 0:
        raise ValueError(f"`eps[0]` ({eps1}) must be >= 0")
    if eps2 < 0:
        raise ValueError(f"`eps[1]` ({eps2}) must be >= 0")

    clip = _check_number("clip_threshold", group["clip_threshold"])
    if clip <= 0:
        raise ValueError(f"`clip_threshold` ({clip}) must be > 0")

    betas = _check_pair("betas", group["betas"], 3)
    checked = []
    for i, beta in enumerate(betas):
        b = _check_number(f"betas[{i}]", beta)
        if not 0.0 <= b < 1.0:
            raise ValueError(f"`betas[{i}]` ({b}) must be in [0, 1)")
        checked.append(b)

    weight_decay = _check_number("weight_decay", group["weight_decay"])
    if weight_decay < 0:
        raise ValueError(f"`weight_decay` ({weight_decay}) must be >= 0")

    instability_init = _check_number("instability_init", group["instability_init"])
    if instability_init < 0:
        raise ValueError(f"`instability_init` ({instability_init}) must be >= 0")

    state_dtype = group["state_dtype"]
    if state_dtype not in STATE_DTYPES:
        raise TypeError(
            f"`state_dtype` ({state_dtype!r}) must be torch.float32 or torch.bfloat16 (the dtype "
            "of the first moment `exp_avg`; the factored statistics are always fp32)"
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
        bias_correction=_check_bool("bias_correction", group["bias_correction"]),
        instability_init=instability_init,
        state_dtype=state_dtype,
        stochastic_rounding=_check_bool("stochastic_rounding", group["stochastic_rounding"]),
    )
