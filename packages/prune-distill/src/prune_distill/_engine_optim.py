"""`distill`'s optimizer, also when an engine keeps the student's gradients (shard-zero).

A sharding engine such as shard-zero's `prepare` reduces the gradients into its own buffers: the
model's parameters never get a `.grad`, and the engine's optimizer steps its shards. `distill`
then works with that optimizer passed as `DistillConfig.optimizer`: `build` checks it holds the
hidden-state projection (a plain module the engine does not know), `check_gradients_reached`
refuses an optimizer over `student.parameters()` that would step nothing, and `clip_` clips
through the optimizer's own `clip_grad_norm_` when it has one.
"""

from __future__ import annotations

import torch
from torch import nn

from prune_distill.config import DistillConfig


def build(
    cfg: DistillConfig, student: list[nn.Parameter], projection: list[nn.Parameter]
) -> torch.optim.Optimizer:
    """The optimizer of `student` + `projection` parameters (`cfg.optimizer`, or AdamW).

    Raises:
        ValueError: if the optimizer the factory returned does not hold the projection.
    """
    params = student + projection
    if cfg.optimizer is not None:
        opt = cfg.optimizer(params)
    else:
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    if any(id(p) not in held for p in projection):
        raise ValueError(
            "the hidden-state projection (the student's width differs from the teacher's) is "
            "not among the parameters of the optimizer `DistillConfig.optimizer` returned, so "
            "it would never be trained (an engine's own optimizer, e.g. shard-zero's, holds "
            "its shards only): step the parameters it is given, or set `hidden_loss_weight` = 0"
        )
    return opt


def check_gradients_reached(opt: torch.optim.Optimizer, student: list[nn.Parameter]) -> None:
    """Raise unless a student parameter that `opt` steps got a gradient (call on the first step).

    An optimizer over `student.parameters()` under an engine that keeps the gradients would
    step nothing while the losses look normal. The engine's own optimizer holds other tensors
    (its shards), so it is not checked.

    Raises:
        RuntimeError: if `opt` holds student parameters and none of them has a gradient.
    """
    ids = {id(p) for group in opt.param_groups for p in group["params"]}
    held = [p for p in student if id(p) in ids]
    if held and all(p.grad is None for p in held):
        raise RuntimeError(
            "no parameter of `student` received a gradient in the first backward, so the "
            "optimizer would step nothing: the student's gradients are kept elsewhere (e.g. by "
            "shard-zero's `prepare`, which reduces them into its own shards). Pass that "
            "engine's optimizer as `DistillConfig.optimizer` (e.g. `optimizer=lambda params: "
            "zero_optimizer`); `max_grad_norm` then clips through its `clip_grad_norm_`"
        )


def clip_(opt: torch.optim.Optimizer, params: list[nn.Parameter], max_norm: float) -> None:
    """Clip the global gradient norm: `opt.clip_grad_norm_` if it has one, else over `params`."""
    clip = getattr(opt, "clip_grad_norm_", None)
    if callable(clip):  # an engine's optimizer over gradients it keeps itself (shard-zero)
        clip(max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
