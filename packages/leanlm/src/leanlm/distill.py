"""Stage `distill`: train the previous stage's (pruned) model to match a teacher's logits.

The loss is `(1 - w) * KL(teacher || student) at temperature T (x T^2) + w * next-token CE`,
with the KL from `prune_distill.forward_kl` (chunked fp32, optionally on the teacher's top-k
logits). The training loop, schedule, checkpoints and evaluation are `leanlm.trainer`'s.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from leanlm.config import DistillConfig
from leanlm.model import load_model
from leanlm.stages import StageContext, StageResult, register_stage
from leanlm.trainer import LossFn, train
from prune_distill import forward_kl


def distillation_loss(teacher: torch.nn.Module, cfg: DistillConfig) -> LossFn:
    """The loss function `train` calls: KL to `teacher`'s logits, mixed with CE."""

    def loss_fn(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=input_ids).logits
        with torch.no_grad():
            target = teacher(input_ids=input_ids).logits.float()
        soft = torch.topk(target, cfg.top_k) if cfg.top_k else target
        loss = forward_kl(logits, tuple(soft) if cfg.top_k else soft, temperature=cfg.temperature)
        if cfg.lm_loss_weight:
            ce = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), input_ids[:, 1:].flatten())
            loss = (1 - cfg.lm_loss_weight) * loss + cfg.lm_loss_weight * ce
        return loss

    return loss_fn


@register_stage
class Distill:
    """Distill `config.distill.teacher_stage`'s model into the previous stage's model."""

    name: ClassVar[str] = "distill"

    def run(self, ctx: StageContext) -> StageResult:
        """Load student and teacher, train the student on the KL, save it."""
        cfg = ctx.config.distill
        if ctx.input_dir is None or cfg.teacher_stage not in ctx.outputs:
            raise ValueError(
                f"the `distill` stage needs a previous stage's model and the teacher stage "
                f"{cfg.teacher_stage!r} to have run; ran: {list(ctx.outputs)}"
            )
        student = load_model(ctx.input_dir)
        teacher = load_model(ctx.outputs[cfg.teacher_stage])
        teacher = teacher.to(ctx.accelerator.device).eval().requires_grad_(False)
        metrics = train(ctx, student, cfg, distillation_loss(teacher, cfg))
        return StageResult(
            stage=self.name,
            config_hash=ctx.config_hash,
            model_dir=ctx.model_dir.relative_to(ctx.run_dir).as_posix(),
            metrics=metrics,
        )
