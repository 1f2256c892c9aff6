"""Stage `distill`: train the previous stage's (pruned) model to match a teacher's logits.

The loss is `(1 - w) * D(teacher, student) at temperature T (x T^2) + w * next-token CE`, `D`
chosen by `loss` from `prune_distill.divergence` (forward KL by default, reverse KL, or the
generalized JSD with `beta`), plus `hidden_loss_weight` times prune-distill's `HiddenStateLoss`;
`teacher_correction_steps` > 0 first fine-tunes a copy of the teacher. The loop is
`leanlm.train.trainer`'s; the loss and teacher correction live in `leanlm.train.distill`,
imported when the stage runs, so loading a config does not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from leanlm.config import DistillConfig
from leanlm.stages.base import Stage, StageContext, StageResult

if TYPE_CHECKING:
    import torch


def loss_label(cfg: DistillConfig) -> str:
    """What the stage's training loss is (the report's axis label for its curve)."""
    what = {"forward_kl": "KL", "reverse_kl": "reverse KL", "jsd": f"JSD (beta={cfg.beta:g})"}
    parts = [f"{what[cfg.loss]} to teacher (T={cfg.temperature:g})"]
    if cfg.lm_loss_weight:
        parts = [f"{1 - cfg.lm_loss_weight:g} x {parts[0]}", f"{cfg.lm_loss_weight:g} x CE"]
    if cfg.hidden_loss_weight:
        parts.append(f"{cfg.hidden_loss_weight:g} x hidden-state loss")
    return " + ".join(parts)


class Distill(Stage):
    """Distill `config.distill.teacher_stage`'s model into the previous stage's model."""

    name: ClassVar[str] = "distill"
    config: ClassVar[type] = DistillConfig
    summary: ClassVar[str] = "knowledge distillation"

    def run(self, ctx: StageContext) -> StageResult:
        """Load student and teacher (correct the teacher), train the student, save it."""
        from leanlm.stages.lineage import pruned_layer_map_for
        from leanlm.train.distill import (
            StudentWithHiddenLoss,
            corrected_teacher,
            distillation_loss,
            save_student,
        )
        from leanlm.train.evaluate import evaluate_validation
        from leanlm.train.model import TRAIN_DTYPE, count_parameters, load_model, load_teacher
        from leanlm.train.trainer import train
        from prune_distill import HiddenStateLoss

        cfg: DistillConfig = ctx.section
        acc = ctx.accelerator
        if ctx.input_dir is None or cfg.teacher_stage not in ctx.outputs:
            raise ValueError(
                f"the `distill` stage needs a previous stage's model and the teacher stage "
                f"{cfg.teacher_stage!r} to have run; ran: {list(ctx.outputs)}"
            )
        student = load_model(ctx.input_dir, dtype=TRAIN_DTYPE)
        vocab = student.get_output_embeddings().weight.shape[0]
        cfg.check_top_k(vocab, "the student's")
        teacher_dir = ctx.outputs[cfg.teacher_stage]
        if cfg.teacher == "cached":
            from leanlm.train.distill import cached_distillation_loss
            from leanlm.train.teacher_cache import ensure_cache

            cache = ensure_cache(ctx, cfg, teacher_dir, vocab_size=vocab)
            metrics = train(ctx, student, cfg, cached_distillation_loss(cache, cfg))
            metrics["teacher_cache_bytes"] = cache.disk_bytes
            return ctx.result(metrics, loss_label=loss_label(cfg))
        # the teacher only runs forward passes: frozen, in its checkpoint's dtype (bf16 for a
        # bf16 checkpoint); a teacher correction trains it, in fp32, then casts it back
        teacher = load_teacher(teacher_dir).to(acc.device)
        extra: dict[str, Any] = {}
        if cfg.teacher_correction_steps:

            def teacher_val_loss(model: torch.nn.Module) -> float:
                return evaluate_validation(ctx, model, batch_size=cfg.eval_batch_size).loss

            extra["teacher_val_loss"] = teacher_val_loss(teacher)
            stored = teacher.dtype
            del teacher
            teacher = load_model(teacher_dir, dtype=TRAIN_DTYPE).to(acc.device)
            teacher = corrected_teacher(ctx, teacher, cfg).to(stored)
            extra["corrected_teacher_val_loss"] = teacher_val_loss(teacher)
            # data the compressed pipeline saw (`control` trains on for as many tokens)
            global_batch = cfg.micro_batch_size * cfg.grad_accum_steps * acc.num_processes
            extra["teacher_correction_tokens"] = (
                cfg.teacher_correction_steps * global_batch * ctx.config.data.seq_len
            )
            acc.print(
                f"[distill] teacher correction ({cfg.teacher_correction_steps} steps): "
                f"validation loss {extra['teacher_val_loss']:.4f} -> "
                f"{extra['corrected_teacher_val_loss']:.4f}"
            )
        teacher = teacher.eval().requires_grad_(False)
        loss_fn = distillation_loss(teacher, cfg)
        if cfg.hidden_loss_weight:
            # a depth-pruned student's layers match the layers they were cut from; else even
            layer_map = pruned_layer_map_for(ctx.run_dir, ctx.input_dir, teacher_dir)
            # the projection (width-pruned student) is seeded by the run's seed, so a run does
            # not depend on what the process ran before (and every process starts the same)
            hidden = HiddenStateLoss.between(
                student, teacher, layer_map or None, seed=ctx.config.seed
            )
            wrapped = StudentWithHiddenLoss(student, hidden)
            metrics = train(ctx, wrapped, cfg, loss_fn, save=save_student)
            metrics["params"] = count_parameters(student)  # the model, not the projection
        else:
            metrics = train(ctx, student, cfg, loss_fn)
        return ctx.result(metrics | extra, loss_label=loss_label(cfg))
