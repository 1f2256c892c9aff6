"""Option checks shared by the `parse_group`s of `Adafactor` and optim-came's `CAME` (public).

Each returns the checked value or raises a `TypeError`/`ValueError` naming the option.
`Scalar` is the type of a checked learning rate: a float or a 0-dim tensor (kept on its device).

Inside `torch.compile` (a compiled `step()`) the finiteness checks are skipped: a float that an LR
scheduler changes every step becomes a symbolic float there, and `math.isfinite` on it breaks
the graph (dynamo then ran the step eagerly and compiled its inner functions one by one, with
wrong results). The constructor and `add_param_group` check it eagerly.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

Scalar = Tensor | float


@dataclass(frozen=True)
class GroupCheck:
    """When a param group's options are parsed, and what that allows.

    `first`: at construction or `add_param_group` (the checks HF makes once, a tensor `lr`'s
    value); `inherited`: the options a new group took from the constructor's defaults;
    `defaults`: the group is the constructor's defaults, whose missing `lr` every param group
    may still give. The default instance is a step's parse.
    """

    first: bool = False
    inherited: frozenset[str] = frozenset()
    defaults: bool = False


STEP = GroupCheck()


def check_bool(name: str, value: object) -> bool:
    """`value` if it is a bool, else a `TypeError` naming `name`."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {value!r} ({type(value).__name__})")
    return value


def check_number(name: str, value: object) -> float:
    """`value` as a finite float, else a `TypeError`/`ValueError` naming `name`.

    Finiteness is not checked inside `torch.compile` (see the module docstring).
    """
    # numbers.Real: also numpy scalars (np.float32 is not a Python float), as torch accepts
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number, got {value!r} ({type(value).__name__})")
    number = float(value)
    if not torch.compiler.is_compiling() and not math.isfinite(number):
        raise ValueError(f"`{name}` ({number}) must be finite")
    return number


def check_non_negative(name: str, value: object) -> float:
    """`check_number(name, value)`, and a `ValueError` naming `name` if it is negative."""
    number = check_number(name, value)
    if number < 0:
        raise ValueError(f"`{name}` ({number}) must be >= 0")
    return number


def check_lr(value: object, *, check_value: bool) -> Scalar:
    """A learning rate: a non-negative real number or a one-element floating-point tensor.

    A tensor is used as is (on its device, no host sync in `step()`); its value is checked only
    when `check_value` (at construction), because reading it synchronises with the device.
    """
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise TypeError(
                f"`lr` as a tensor must hold one floating-point value, got shape "
                f"{tuple(value.shape)} and dtype {value.dtype}"
            )
        if check_value:
            number = float(value.detach().cpu().reshape(()).item())
            if not math.isfinite(number) or number < 0:
                raise ValueError(f"`lr` ({number}) must be finite and >= 0")
        return value.reshape(())
    lr = check_number("lr", value)
    if lr < 0:
        raise ValueError(f"`lr` ({lr}) must be >= 0")
    return lr
