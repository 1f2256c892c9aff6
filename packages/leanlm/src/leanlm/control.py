"""Stage `control`: the dense pretrained model trained on for the compression stages' tokens.

Compression stages see data after pretraining (calibration sequences, distillation, the sparse
fine-tune), so a compressed model that scores as well as the pretrained one may only have had
more data. This stage gives the dense model the same data budget: it continues the `pretrain`
stage's model (or `init_model`) with next-token loss for the tokens the stages between them used,
and scores it on the same validation windows; the report compares the last compressed model
against it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, ClassVar

from leanlm.configio import ConfigError
from leanlm.sections import INIT_STAGE, TrainConfig
from leanlm.stages import Stage, StageContext, StageResult, register_stage

if TYPE_CHECKING:
    from leanlm.config import RunConfig

DENSE_STAGE = "pretrain"
"""The stage whose model the control continues (`init_model` when the run has no pretrain)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControlConfig(TrainConfig):
    """Stage `control`: train the dense pretrained model on, as a fair baseline for compression.

    It continues the `pretrain` stage's model (or `init_model`) with next-token loss for as many
    tokens as the stages between it and `pretrain` used (their `tokens` plus calibration tokens,
    read from their results), rounded up to whole optimizer steps, and scores it on the same
    validation windows. So `steps` is not read: the stage computes it. Everything else (optimizer,
    learning rate, batch, ...) is as in the other training stages.
    """

    _steps_given: ClassVar[bool] = False

    steps: int = 1
    """Not read: the stage trains for the compression stages' tokens (see above)."""
    warmup_steps: int = 5
    """Linear warmup steps (at most the computed steps - 1)."""
    lr: float = 1e-3


def compression_tokens(ctx: StageContext) -> dict[str, int]:
    """Tokens each stage after the dense model used, from their stored results, by stage.

    A stage's count is its `tokens` metric (trained tokens; for `prune`, its calibration tokens)
    plus its `calibration_tokens` metric where it has one (`sparsify`).
    """
    used = {}
    for name in ctx.config.stages[: ctx.config.stages.index("control")]:
        if name == DENSE_STAGE:
            continue
        result = StageResult.load(ctx.run_dir / name)
        if result is None:
            raise RuntimeError(f"[control] the result of stage {name!r} is missing")
        m = result.metrics
        used[name] = int(m.get("tokens", 0)) + int(m.get("calibration_tokens", 0))
    return used


def control_steps(tokens: int, cfg: ControlConfig, *, processes: int, seq_len: int) -> int:
    """Optimizer steps that train on at least `tokens` tokens (at least one step)."""
    per_step = cfg.micro_batch_size * cfg.grad_accum_steps * processes * seq_len
    return max(1, math.ceil(tokens / per_step))


@register_stage
class Control(Stage):
    """Train the dense model on for the compression stages' tokens and score it."""

    name: ClassVar[str] = "control"
    config: ClassVar[type] = ControlConfig
    summary: ClassVar[str] = "the dense model trained on for the same tokens"

    @classmethod
    def check_run(cls, run: RunConfig) -> None:
        """`control` comes last, after a compression stage, with a dense model to continue."""
        if cls.name not in run.stages:
            return
        compared = [s for s in run.stages[:-1] if s != DENSE_STAGE]
        if run.stages[-1] != cls.name or not compared:
            raise ConfigError(
                "stages",
                "'control' must be the last stage, after the compression stages it is "
                f"compared with: {list(run.stages)}",
            )
        if run.stages[0] != DENSE_STAGE and not run.init_model:
            raise ConfigError("stages", "'control' needs 'pretrain' first or `init_model`")

    def run(self, ctx: StageContext) -> StageResult:
        """Count the compression stages' tokens, train the dense model that long, save it."""
        from leanlm.evaluate import causal_lm_loss
        from leanlm.model import TRAIN_DTYPE, load_model
        from leanlm.trainer import train

        source = ctx.outputs.get(DENSE_STAGE, ctx.outputs.get(INIT_STAGE))
        if source is None:
            raise ValueError(
                f"the `control` stage needs the {DENSE_STAGE!r} stage's model or `init_model`; "
                f"ran: {list(ctx.outputs)}"
            )
        used = compression_tokens(ctx)
        target = sum(used.values())
        base: ControlConfig = ctx.section
        steps = control_steps(
            target,
            base,
            processes=ctx.accelerator.num_processes,
            seq_len=ctx.config.data.seq_len,
        )
        cfg = dataclasses.replace(base, steps=steps, warmup_steps=min(base.warmup_steps, steps - 1))
        ctx.accelerator.print(
            f"[control] the dense model trains on for {target:,} tokens "
            f"({', '.join(f'{k} {v:,}' for k, v in used.items())}): {steps} steps"
        )
        metrics = train(ctx, load_model(source, dtype=TRAIN_DTYPE), cfg, causal_lm_loss)
        metrics["target_tokens"] = target
        stages = ctx.config.stages
        last = StageResult.load(ctx.run_dir / stages[stages.index(self.name) - 1])
        notes = [f"the dense model trained on for {target:,} tokens ({', '.join(used)})."]
        if last is not None and last.stage != DENSE_STAGE:
            notes.append(cost_note(last, metrics))
        return ctx.result(metrics, notes=notes)


def cost_note(compressed: StageResult, control: dict[str, Any]) -> str:
    """What compression cost: the compressed model's perplexity against the control's."""
    ppl, base = compressed.metrics["val_perplexity"], control["val_perplexity"]
    size = compressed.metrics.get("nonzero_params", compressed.metrics.get("params", 0))
    return (
        f"**What compression cost at equal tokens:** `{compressed.stage}` "
        f"({size / 1e6:.2f}M non-zero parameters) scores validation perplexity {ppl:.2f}, "
        f"`control` (dense, {control['params'] / 1e6:.2f}M parameters) {base:.2f}: "
        f"{ppl - base:+.2f} ({(ppl - base) / base:+.1%})."
    )
