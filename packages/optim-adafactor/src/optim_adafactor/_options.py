"""Validation of constructor / param-group options and the per-step scalar schedules.

Everything here is host-side Python on floats and ints: no tensor is touched, so nothing here can
cause a device synchronisation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from optim_adafactor.checks import (
    STEP,
    GroupCheck,
    Scalar,
    check_bool,
    check_lr,
    check_non_negative,
    check_number,
)

Semantics = Literal["hf", "t2t", "torch"]
SEMANTICS: tuple[str, ...] = get_args(Semantics)

#: Storage of the momentum `exp_avg` (`state_dtype`): fp32, or blockwise int8 (`quant`).
STATE_DTYPES = (torch.float32, torch.int8)

#: T2T multiplies the relative step by this when parameter scaling is off.
T2T_UNSCALED_FACTOR = 0.05


@dataclass(frozen=True, slots=True)
class GroupOptions:
    """The validated, normalised options of one param group."""

    semantics: Semantics
    lr: Scalar | None
    eps1: float | None  # None only for semantics="torch": finfo(param dtype).eps
    eps2: float
    clip_threshold: float | None
    decay_rate: float
    beta1: float | None
    weight_decay: float
    scale_parameter: bool
    relative_step: bool
    warmup_init: bool
    maximize: bool
    stochastic_rounding: bool
    state_dtype: torch.dtype = torch.float32

    @property
    def needs_param_rms(self) -> bool:
        """Whether the step size depends on RMS(p) (one extra read of the parameter)."""
        return self.semantics == "torch" or self.scale_parameter

    def beta2(self, step: int) -> float:
        """`β2_t = 1 - t^decay_rate` (HF/T2T/paper); torch lerps with weight `1 - β2_t`."""
        # `**`, not `math.pow`: under torch.compile the step stays symbolic (math.pow burns it
        # into the graph, one recompile per step); the same C pow either way
        rate: float = step**self.decay_rate
        return 1.0 - rate

    def relative_step_size(self, step: int) -> Scalar:
        """The step size before parameter scaling (HF `_get_lr` without the RMS factor).

        - hf: `lr`, or `min(1e-6·t if warmup_init else 1e-2, 1/√t)` with `relative_step`.
        - t2t: `min(1e-2, 1/√t)`, times 0.05 without parameter scaling.
        - torch: `min(lr, 1/√t)` (the group lr only caps rho_t).
        """
        inv_sqrt = 1.0 / math.sqrt(step)
        if self.semantics == "torch":
            assert self.lr is not None
            if isinstance(self.lr, Tensor):
                return self.lr.clamp(max=inv_sqrt)
            return min(self.lr, inv_sqrt)
        if self.semantics == "t2t":
            rho = min(1e-2, inv_sqrt)
            return rho if self.scale_parameter else rho * T2T_UNSCALED_FACTOR
        if self.relative_step:
            cap = 1e-6 * step if self.warmup_init else 1e-2
            return min(cap, inv_sqrt)
        assert self.lr is not None
        return self.lr


def parse_group(group: Mapping[str, Any], check: GroupCheck = STEP) -> GroupOptions:
    """Validate one param group's options; raise `ValueError`/`TypeError` naming the culprit.

    `check.first` (construction, `add_param_group`) adds the checks HF makes only in its
    constructor: an `lr` given with `relative_step=True` (`step()` ignores `lr` then, so that
    HF's `AdafactorSchedule` may write into it) and a tensor `lr`'s value (a host read). An
    `lr` in `check.inherited` (from the defaults) is ignored with `relative_step=True`; in the
    constructor's defaults (`check.defaults`) a missing `lr` may still come from every group.
    """
    semantics = group["semantics"]
    if semantics not in SEMANTICS:
        raise ValueError(f"`semantics` ({semantics!r}) must be one of {SEMANTICS}")
    for name in ("scale_parameter", "relative_step", "warmup_init", "maximize"):
        check_bool(name, group[name])
    check_bool("stochastic_rounding", group["stochastic_rounding"])

    eps = group["eps"]
    if not isinstance(eps, tuple | list) or len(eps) != 2:
        raise TypeError(f"`eps` must be a pair (eps1, eps2), got {eps!r}")
    eps1_raw, eps2_raw = eps
    eps1 = None if eps1_raw is None else check_number("eps[0]", eps1_raw)
    eps2 = check_number("eps[1]", eps2_raw)
    if eps1 is None and semantics != "torch":
        raise ValueError(
            f"`eps[0]` may be None only with semantics='torch' (got semantics={semantics!r}); "
            "HF and T2T add eps1 (default 1e-30) to the squared gradient"
        )
    if eps1 is not None and eps1 < 0:
        raise ValueError(f"`eps[0]` ({eps1}) must be >= 0")
    if eps2 < 0:
        raise ValueError(f"`eps[1]` ({eps2}) must be >= 0")

    clip = group["clip_threshold"]
    if clip is not None:
        clip = check_number("clip_threshold", clip)
        if clip <= 0:
            raise ValueError(f"`clip_threshold` ({clip}) must be > 0, or None to disable clipping")
        if semantics == "torch" and clip < 1:
            raise ValueError(f"`clip_threshold` ({clip}) must be >= 1 with semantics='torch'")
    elif semantics == "torch":
        raise ValueError("`clip_threshold` must be a number >= 1 with semantics='torch'")

    decay_rate = check_number("decay_rate", group["decay_rate"])
    if decay_rate > 0:
        raise ValueError(f"`decay_rate` ({decay_rate}) must be <= 0 (β2_t = 1 - t^decay_rate)")

    beta1 = group["beta1"]
    if beta1 is not None:
        beta1 = check_number("beta1", beta1)
        if not 0.0 <= beta1 < 1.0:
            raise ValueError(f"`beta1` ({beta1}) must be in [0, 1), or None for no momentum")

    weight_decay = check_non_negative("weight_decay", group["weight_decay"])

    lr = group["lr"]
    if lr is not None:
        lr = check_lr(lr, check_value=check.first)

    relative_step, warmup_init = group["relative_step"], group["warmup_init"]
    scale_parameter = group["scale_parameter"]
    if semantics == "hf":
        if relative_step and (not check.first or "lr" in check.inherited):
            lr = None  # ignored, as in HF (a proxy scheduler may have written into it)
        if lr is not None and relative_step:
            raise ValueError(
                f"`lr` ({lr}) cannot be combined with `relative_step=True`: pass "
                "`relative_step=False` to use an external learning rate"
            )
        if lr is None and not relative_step and not check.defaults:
            raise ValueError(
                "`lr` must be given when `relative_step=False` (to the constructor or to this "
                "param group)"
            )
        if warmup_init and not relative_step:
            raise ValueError("`warmup_init=True` requires `relative_step=True`")
    elif semantics == "t2t":
        if not check.first or "lr" in check.inherited:
            lr = None  # ignored (the relative step is fixed)
        if lr is not None or not relative_step or warmup_init:
            raise ValueError(
                "semantics='t2t' uses the paper's relative step rho_t = min(1e-2, 1/√t): it needs "
                f"`lr=None`, `relative_step=True`, `warmup_init=False` (got lr={lr!r}, "
                f"relative_step={relative_step}, warmup_init={warmup_init})"
            )
        if weight_decay != 0:
            raise ValueError(f"`weight_decay` ({weight_decay}) must be 0 with semantics='t2t'")
    else:  # torch
        if lr is None:
            lr = 1e-2
        if not relative_step or not scale_parameter or warmup_init:
            raise ValueError(
                "semantics='torch' always uses the relative step and parameter scaling: it needs "
                f"`relative_step=True`, `scale_parameter=True`, `warmup_init=False` (got "
                f"relative_step={relative_step}, scale_parameter={scale_parameter}, "
                f"warmup_init={warmup_init})"
            )
        if beta1 is not None:
            raise ValueError(f"`beta1` ({beta1}) must be None with semantics='torch' (no momentum)")

    state_dtype = group.get("state_dtype", torch.float32)
    if state_dtype not in STATE_DTYPES:
        raise TypeError(
            f"`state_dtype` ({state_dtype!r}) must be torch.float32 or torch.int8 (the storage "
            "of the momentum `exp_avg`; int8: blockwise 8-bit codes with fp32 scales; the "
            "factored statistics are always fp32)"
        )
    if state_dtype == torch.int8 and beta1 is None:
        raise ValueError(
            "`state_dtype=torch.int8` stores the momentum `exp_avg` in 8 bits, but `beta1` is "
            "None (no momentum): set `beta1` (e.g. 0.9) or keep `state_dtype=torch.float32`"
        )

    return GroupOptions(
        semantics=semantics,
        lr=lr,
        eps1=eps1,
        eps2=eps2,
        clip_threshold=clip,
        decay_rate=decay_rate,
        beta1=beta1,
        weight_decay=weight_decay,
        scale_parameter=scale_parameter,
        relative_step=relative_step,
        warmup_init=warmup_init,
        maximize=group["maximize"],
        stochastic_rounding=group["stochastic_rounding"],
        state_dtype=state_dtype,
    )
