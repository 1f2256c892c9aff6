"""Stage `distill`: train the previous stage's (pruned) model to match a teacher's logits.

The loss is `(1 - w) * D(teacher, student) at temperature T (x T^2) + w * next-token CE`, with
the divergence `D` chosen by `loss` (forward KL(teacher || student) by default, reverse KL or the
generalized JSD with `beta`) from `prune_distill.divergence` (chunked fp32 on CPU, the fused
Triton kernels on CUDA; optionally on the teacher's top-k logits), plus `hidden_loss_weight`
times prune-distill's `HiddenStateLoss` between matched layer outputs when that weight is > 0.
With `teacher_correction_steps` > 0 a copy of the teacher is first fine-tuned on the
distillation batches (`prune_distill.correct_teacher`). The training
loop, schedule, checkpoints and evaluation are `leanlm.trainer`'s; the loss function, the
student wrapped with its hidden-state loss and the teacher correction are in
`leanlm.distill_train` (imported when the stage runs: loading a config does not load torch).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import prune_distill
from leanlm.configio import ConfigError, library_errors, non_negative
from leanlm.sections import INIT_STAGE, TrainConfig
from leanlm.stages import Stage, StageContext, StageResult, register_stage

if TYPE_CHECKING:
    import torch

    from leanlm.config import RunConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillConfig(TrainConfig):
    """Stage `distill`: train the previous stage's model to match a teacher's logits.

    The loss settings are `prune_distill.DistillConfig`'s (`options`), which checks them; the
    training settings are the other training stages'.
    """

    teacher_stage: str = "pretrain"
    """The earlier stage whose model is the teacher (`"init"`: `RunConfig.init_model`)."""
    teacher: Literal["online", "cached"] = "online"
    """`online`: the teacher (frozen, in its checkpoint's dtype) runs beside the student on
    every micro-batch. `cached`: before training, the main process writes the teacher's
    top-`top_k` logits (all of them with `top_k` = 0) of every micro-batch of the stage to
    `distill/teacher-cache` once (`prune_distill.cache_teacher_topk`; atomically, reused by a
    resume with the same settings), the others wait, and the student then trains from the
    files without the teacher in memory. Disk: `steps` x sequences per step x `seq_len` x
    (8 k + 8) bytes (fp32 values, int32 indices, int64 token ids), logged. Not with
    `hidden_loss_weight` or `teacher_correction_steps` (they need the teacher model)."""
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    """The distillation divergence between the teacher's and the student's next-token
    distributions (prune-distill's `divergence`): `forward_kl` KL(teacher || student)
    (Minitron's), `reverse_kl` KL(student || teacher) (mode seeking, MiniLLM) or `jsd`, the
    generalized Jensen-Shannon divergence with mixture weight `beta`. `reverse_kl` (and `jsd`
    with `beta` = 1) needs the teacher's full distribution, so it is refused with `top_k` > 0
    (online or cached); `jsd` with `beta` < 1 stays finite on the renormalised top-k teacher."""
    beta: float = 0.5
    """`jsd`'s teacher weight in the mixture `m = beta * teacher + (1 - beta) * student`, in
    [0, 1]: 0 is the forward KL, 1 the reverse KL, 0.5 the symmetric JSD (TRL's and
    Liger-Kernel's convention). Read by `loss = "jsd"` only; checked to be in [0, 1] always."""
    temperature: float = 1.0
    """Softmax temperature of the divergence (the loss is scaled by T^2)."""
    lm_loss_weight: float = 0.0
    """Weight of the next-token cross-entropy in the loss (the KL gets 1 - this)."""
    top_k: int = 0
    """Distill on the teacher's top-k logits only (0 = the full vocabulary)."""
    hidden_loss_weight: float = 0.0
    """Weight of prune-distill's intermediate hidden-state loss, added to the KL/CE mix (0 = off):
    1 - cosine between student and teacher layer outputs after each model's final norm. When
    the `prune` stage made the student from this teacher, each student layer is matched to the
    layer it was cut from; otherwise the student's layers are spread evenly over the teacher's
    (last onto last). When the hidden sizes
    differ, a learned linear map to the teacher's width (initialised from the run's `seed`)
    trains with the student; it is kept in the training checkpoints but not in the saved model.
    Minitron found it helps only when depth is cut a lot."""
    teacher_correction_steps: int = 0
    """Before distilling, fine-tune a copy of the teacher for this many optimizer steps on the
    distillation data (Minitron's "teacher correction": next-token loss, the stage's optimizer,
    batch size and `grad_clip`, constant LR, the same batches as the first distillation steps;
    every process computes the same corrected teacher). 0 = off."""
    teacher_correction_lr: float = 0.0
    """Learning rate of the teacher correction (0 = `lr` / 5, the ratio Minitron's second paper
    is reported to use for its teacher's fine-tune)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.lm_loss_weight <= 1.0:  # a mix: the KL gets the rest
            raise ConfigError("lm_loss_weight", f"must be in [0, 1], got {self.lm_loss_weight}")
        with library_errors(self):
            self.options  # noqa: B018  (prune-distill checks the loss settings)
        non_negative(self, "teacher_correction_steps", zero="no correction")
        non_negative(self, "teacher_correction_lr", zero="`lr` / 5")
        if self.teacher == "cached":
            for key in ("hidden_loss_weight", "teacher_correction_steps"):
                if getattr(self, key):
                    raise ConfigError(
                        key,
                        f"({getattr(self, key)}) needs the teacher model, which `teacher = "
                        '"cached"` does not load: set it to 0 or use `teacher = "online"`',
                    )

    @property
    def options(self) -> prune_distill.DistillConfig:
        """The loss settings as `prune_distill.DistillConfig` (the KL weighted 1 - CE weight)."""
        return prune_distill.DistillConfig(
            temperature=self.temperature,
            kl_weight=1.0 - self.lm_loss_weight,
            lm_loss_weight=self.lm_loss_weight,
            top_k=self.top_k or None,
            hidden_loss_weight=self.hidden_loss_weight,
            loss=self.loss,
            beta=self.beta,
        )


def loss_label(cfg: DistillConfig) -> str:
    """What the stage's training loss is (the report's axis label for its curve)."""
    what = {"forward_kl": "KL", "reverse_kl": "reverse KL", "jsd": f"JSD (beta={cfg.beta:g})"}
    parts = [f"{what[cfg.loss]} to teacher (T={cfg.temperature:g})"]
    if cfg.lm_loss_weight:
        parts = [f"{1 - cfg.lm_loss_weight:g} x {parts[0]}", f"{cfg.lm_loss_weight:g} x CE"]
    if cfg.hidden_loss_weight:
        parts.append(f"{cfg.hidden_loss_weight:g} x hidden-state loss")
    return " + ".join(parts)


@register_stage
class Distill(Stage):
    """Distill `config.distill.teacher_stage`'s model into the previous stage's model."""

    name: ClassVar[str] = "distill"
    config: ClassVar[type] = DistillConfig
    summary: ClassVar[str] = "knowledge distillation"

    @classmethod
    def check_run(cls, run: RunConfig) -> None:
        """The teacher is a stage that runs before `distill` (or `init` with `init_model`)."""
        if cls.name not in run.stages:
            return
        teacher = run.distill.teacher_stage
        before = list(run.stages[: run.stages.index(cls.name)])
        if run.init_model:
            before.append(INIT_STAGE)
        if teacher not in before:
            init = " (or 'init' for `init_model`)" if run.init_model else ""
            raise ConfigError(
                "distill.teacher_stage",
                f"{teacher!r} must be a stage that runs before 'distill'{init}; "
                f"stages: {list(run.stages)}",
            )

    def run(self, ctx: StageContext) -> StageResult:
        """Load student and teacher (correct the teacher), train the student, save it."""
        from leanlm.distill_train import (
            StudentWithHiddenLoss,
            corrected_teacher,
            distillation_loss,
            save_student,
        )
        from leanlm.evaluate import evaluate_perplexity
        from leanlm.lineage import pruned_layer_map_for
        from leanlm.model import TRAIN_DTYPE, count_parameters, load_model, load_teacher
        from leanlm.trainer import train
        from prune_distill import HiddenStateLoss

        cfg: DistillConfig = ctx.section
        acc = ctx.accelerator
        if ctx.input_dir is None or cfg.teacher_stage not in ctx.outputs:
            raise ValueError(
                f"the `distill` stage needs a previous stage's model and the teacher stage "
                f"{cfg.teacher_stage!r} to have run; ran: {list(ctx.outputs)}"
            )
        student = load_model(ctx.input_dir, dtype=TRAIN_DTYPE)
        teacher_dir = ctx.outputs[cfg.teacher_stage]
        if cfg.teacher == "cached":
            from leanlm.distill_train import cached_distillation_loss
            from leanlm.teacher_cache import ensure_cache

            vocab = student.get_output_embeddings().weight.shape[0]
            cache = ensure_cache(ctx, cfg, teacher_dir, vocab_size=vocab)
            metrics = train(ctx, student, cfg, cached_distillation_loss(cache, cfg))
            metrics["teacher_cache_bytes"] = cache.disk_bytes
            return ctx.result(metrics, loss_label=loss_label(cfg))
        # the teacher only runs forward passes: frozen, in its checkpoint's dtype (bf16 for a
        # bf16 checkpoint); a teacher correction trains it, in fp32, then casts it back
        teacher = load_teacher(teacher_dir).to(acc.device)
        extra: dict[str, Any] = {}
        if cfg.teacher_correction_steps:
            windows = ctx.resources.validation_windows

            def teacher_val_loss(model: torch.nn.Module) -> float:
                return evaluate_perplexity(
                    model, windows, batch_size=cfg.eval_batch_size, autocast=acc.autocast
                ).loss

            extra["teacher_val_loss"] = teacher_val_loss(teacher)
            stored = teacher.dtype
            del teacher
            teacher = load_model(teacher_dir, dtype=TRAIN_DTYPE).to(acc.device)
            teacher = corrected_teacher(ctx, teacher, cfg).to(stored)
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
