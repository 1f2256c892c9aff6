"""The training pieces of stage `distill` (`leanlm.distill`), imported when the stage runs.

`distillation_loss` is the loss function the trainer calls (the configured divergence to the
teacher's logits, mixed with CE, plus the hidden-state loss); `StudentWithHiddenLoss` trains the
student together with the hidden-state loss's projection; `corrected_teacher` is Minitron's
teacher correction on the stage's data.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from leanlm.stages.base import StageContext
from leanlm.train.optim import decay_param_groups, optimizer_over
from leanlm.train.teacher_cache import CachedTeacher, stage_micro_batches
from prune_distill import HiddenStateLoss, correct_teacher, divergence

if TYPE_CHECKING:
    from leanlm.config import DistillConfig
    from leanlm.train.trainer import LossFn


class StudentWithHiddenLoss(torch.nn.Module):
    """The student and the `HiddenStateLoss` whose projection (if any) trains with it.

    The trainer prepares, checkpoints and optimises this module as a whole, so the projection
    is in the optimizer and in the resumable checkpoints; the saved model is `student` alone.
    Called without `teacher_states` it is the bare student (evaluation calls it so).
    """

    def __init__(self, student: torch.nn.Module, hidden: HiddenStateLoss) -> None:
        super().__init__()
        self.student = student
        self.hidden = hidden

    def forward(
        self, input_ids: torch.Tensor, teacher_states: tuple[torch.Tensor, ...] | None = None
    ) -> Any:
        """The student's output, or `(logits, hidden-state loss)` given the teacher's states."""
        if teacher_states is None:
            return self.student(input_ids=input_ids)
        out = self.student(input_ids=input_ids, output_hidden_states=True)
        return out.logits, self.hidden(out.hidden_states, teacher_states)


def save_student(
    model: torch.nn.Module, folder: Path, state_dict: dict[str, torch.Tensor] | None
) -> None:
    """Save `StudentWithHiddenLoss.student` only (the projection is not part of the model)."""
    assert isinstance(model, StudentWithHiddenLoss)
    if state_dict is not None:
        prefix = "student."
        state_dict = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    from leanlm.train.trainer import save_pretrained

    save_pretrained(model.student, folder, state_dict)


def distillation_loss(teacher: torch.nn.Module, cfg: DistillConfig) -> LossFn:
    """The loss function `train` calls: `cfg.loss` to `teacher`'s logits, mixed with CE.

    With `hidden_loss_weight` > 0 it adds the hidden-state loss, and `train` must be given a
    `StudentWithHiddenLoss`.
    """
    opts = cfg.options
    hidden = opts.hidden_loss_weight > 0

    def loss_fn(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        if hidden:
            with torch.no_grad():
                out = teacher(input_ids=input_ids, output_hidden_states=True)
                target = out.logits.float()
            logits, hidden_loss = model(input_ids=input_ids, teacher_states=out.hidden_states)
        else:
            logits = model(input_ids=input_ids).logits
            with torch.no_grad():
                target = teacher(input_ids=input_ids).logits.float()
        soft = tuple(torch.topk(target, opts.top_k)) if opts.top_k else target
        loss = _kl_and_ce(logits, soft, input_ids, cfg)  # type: ignore[arg-type]
        if hidden:
            loss = loss + opts.hidden_loss_weight * hidden_loss
        return loss

    return loss_fn


def cached_distillation_loss(cache: CachedTeacher, cfg: DistillConfig) -> LossFn:
    """`distillation_loss` with the teacher's top-k logits read from `cache` (no teacher).

    A cache of the whole vocabulary (`top_k` = 0) is scattered back to dense logits for the
    reverse KL and the JSD, which are then exactly the online losses (and may run the fused
    kernel); the forward KL reads the top-k pair as before.
    """

    def loss_fn(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=input_ids).logits
        values, indices = cache.lookup(input_ids)
        soft: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = (values, indices)
        if cfg.loss != "forward_kl" and values.shape[-1] == logits.shape[-1]:
            soft = values.new_empty(logits.shape).scatter_(-1, indices, values)
        return _kl_and_ce(logits, soft, input_ids, cfg)

    return loss_fn


def _kl_and_ce(
    logits: torch.Tensor,
    soft: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    input_ids: torch.Tensor,
    cfg: DistillConfig,
) -> torch.Tensor:
    """The divergence to the teacher (dense or top-k logits) mixed with next-token CE."""
    opts = cfg.options
    loss = divergence(logits, soft, loss=opts.loss, beta=opts.beta, temperature=opts.temperature)
    if opts.lm_loss_weight:
        ce = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), input_ids[:, 1:].flatten())
        loss = opts.kl_weight * loss + opts.lm_loss_weight * ce
    return loss


def _correction_batches(ctx: StageContext, cfg: DistillConfig) -> Iterator[dict[str, Any]]:
    """The first `teacher_correction_steps` global batches of the stage, in micro-batches."""
    for micro in stage_micro_batches(ctx, cfg, steps=cfg.teacher_correction_steps):
        yield {"input_ids": micro.to(ctx.accelerator.device)}


def corrected_teacher(
    ctx: StageContext, teacher: torch.nn.Module, cfg: DistillConfig
) -> torch.nn.Module:
    """`prune_distill.correct_teacher` on the stage's data with the stage's optimizer."""
    lr = cfg.teacher_correction_lr or cfg.lr / 5

    def make_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        groups = decay_param_groups(params, cfg.weight_decay)
        return optimizer_over(
            cfg.optimizer, groups, lr=lr, betas=cfg.betas, state_dtype=cfg.state_dtype
        )

    world = ctx.accelerator.num_processes
    return correct_teacher(
        teacher,
        _correction_batches(ctx, cfg),
        steps=cfg.teacher_correction_steps,
        optimizer=make_optimizer,
        grad_accumulation_steps=cfg.grad_accum_steps * world,
        max_grad_norm=cfg.grad_clip or None,
    )
