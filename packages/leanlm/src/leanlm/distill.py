"""Stage `distill`: train the previous stage's (pruned) model to match a teacher's logits.

The loss is `(1 - w) * KL(teacher || student) at temperature T (x T^2) + w * next-token CE`,
with the KL from `prune_distill.forward_kl` (chunked fp32, optionally on the teacher's top-k
logits), plus `hidden_loss_weight` times prune-distill's `HiddenStateLoss` between matched layer
outputs when that weight is > 0. With `teacher_correction_steps` > 0 a copy of the teacher is
first fine-tuned on the distillation batches (`prune_distill.correct_teacher`). The training
loop, schedule, checkpoints and evaluation are `leanlm.trainer`'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from leanlm.config import DistillConfig
from leanlm.data import global_batch_indices
from leanlm.evaluate import evaluate_perplexity
from leanlm.model import count_parameters, load_model
from leanlm.optim import decay_param_groups, optimizer_over
from leanlm.prune import pruned_layer_map_for
from leanlm.stages import StageContext, StageResult, register_stage
from leanlm.trainer import LossFn, save_pretrained, train
from prune_distill import HiddenStateLoss, correct_teacher, forward_kl


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


def _save_student(
    model: torch.nn.Module, folder: Path, state_dict: dict[str, torch.Tensor] | None
) -> None:
    """Save `StudentWithHiddenLoss.student` only (the projection is not part of the model)."""
    assert isinstance(model, StudentWithHiddenLoss)
    if state_dict is not None:
        prefix = "student."
        state_dict = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    save_pretrained(model.student, folder, state_dict)


def distillation_loss(teacher: torch.nn.Module, cfg: DistillConfig) -> LossFn:
    """The loss function `train` calls: KL to `teacher`'s logits, mixed with CE.

    With `hidden_loss_weight` > 0 it adds the hidden-state loss, and `train` must be given a
    `StudentWithHiddenLoss`.
    """
    hidden = cfg.hidden_loss_weight > 0

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
        soft = torch.topk(target, cfg.top_k) if cfg.top_k else target
        loss = forward_kl(logits, tuple(soft) if cfg.top_k else soft, temperature=cfg.temperature)
        if cfg.lm_loss_weight:
            ce = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), input_ids[:, 1:].flatten())
            loss = (1 - cfg.lm_loss_weight) * loss + cfg.lm_loss_weight * ce
        if hidden:
            loss = loss + cfg.hidden_loss_weight * hidden_loss
        return loss

    return loss_fn


def _correction_batches(ctx: StageContext, cfg: DistillConfig) -> Iterator[dict[str, Any]]:
    """The first `teacher_correction_steps` global batches of the stage, in micro-batches.

    Every process walks the whole global batch, so all of them correct the teacher identically
    without communicating.
    """
    blocks = ctx.resources.train_blocks
    global_batch = cfg.micro_batch_size * cfg.grad_accum_steps * ctx.accelerator.num_processes
    for step in range(cfg.teacher_correction_steps):
        indices = global_batch_indices(
            step, global_batch=global_batch, num_blocks=blocks.shape[0], seed=ctx.config.seed
        )
        chunk = blocks[indices]
        for start in range(0, global_batch, cfg.micro_batch_size):
            micro = chunk[start : start + cfg.micro_batch_size]
            yield {"input_ids": micro.to(ctx.accelerator.device)}


def corrected_teacher(
    ctx: StageContext, teacher: torch.nn.Module, cfg: DistillConfig
) -> torch.nn.Module:
    """`prune_distill.correct_teacher` on the stage's data with the stage's optimizer."""
    lr = cfg.teacher_correction_lr or cfg.lr / 5

    def make_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        groups = decay_param_groups(params, cfg.weight_decay)
        return optimizer_over(cfg.optimizer, groups, lr=lr, betas=cfg.betas)

    world = ctx.accelerator.num_processes
    return correct_teacher(
        teacher,
        _correction_batches(ctx, cfg),
        steps=cfg.teacher_correction_steps,
        optimizer=make_optimizer,
        grad_accumulation_steps=cfg.grad_accum_steps * world,
        max_grad_norm=cfg.grad_clip or None,
    )


@register_stage
class Distill:
    """Distill `config.distill.teacher_stage`'s model into the previous stage's model."""

    name: ClassVar[str] = "distill"

    def run(self, ctx: StageContext) -> StageResult:
        """Load student and teacher (correct the teacher), train the student, save it."""
        cfg = ctx.config.distill
        acc = ctx.accelerator
        if ctx.input_dir is None or cfg.teacher_stage not in ctx.outputs:
            raise ValueError(
                f"the `distill` stage needs a previous stage's model and the teacher stage "
                f"{cfg.teacher_stage!r} to have run; ran: {list(ctx.outputs)}"
            )
        student = load_model(ctx.input_dir)
        teacher = load_model(ctx.outputs[cfg.teacher_stage]).to(acc.device)
        extra: dict[str, Any] = {}
        if cfg.teacher_correction_steps:
            windows = ctx.resources.validation_windows

            def teacher_val_loss(model: torch.nn.Module) -> float:
                return evaluate_perplexity(
                    model, windows, batch_size=cfg.eval_batch_size, autocast=acc.autocast
                ).loss

            extra["teacher_val_loss"] = teacher_val_loss(teacher)
            teacher = corrected_teacher(ctx, teacher, cfg)
            extra["corrected_teacher_val_loss"] = teacher_val_loss(teacher)
            acc.print(
                f"[distill] teacher correction ({cfg.teacher_correction_steps} steps): "
                f"validation loss {extra['teacher_val_loss']:.4f} -> "
                f"{extra['corrected_teacher_val_loss']:.4f}"
            )
        teacher = teacher.eval().requires_grad_(False)
        loss_fn = distillation_loss(teacher, cfg)
        if cfg.hidden_loss_weight:
            # a depth-pruned student's layers match the layers they were cut from; else even
            layer_map = pruned_layer_map_for(ctx, ctx.input_dir, ctx.outputs[cfg.teacher_stage])
            hidden = HiddenStateLoss.between(student, teacher, layer_map or None)
            wrapped = StudentWithHiddenLoss(student, hidden)
            metrics = train(ctx, wrapped, cfg, loss_fn, save=_save_student)
            metrics["params"] = count_parameters(student)  # the model, not the projection
        else:
            metrics = train(ctx, student, cfg, loss_fn)
        return StageResult(
            stage=self.name,
            config_hash=ctx.config_hash,
            model_dir=ctx.model_dir.relative_to(ctx.run_dir).as_posix(),
            metrics=metrics | extra,
        )
