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
from typing import Any, ClassVar

from leanlm.config import DENSE_STAGE, INIT_STAGE, ControlConfig
from leanlm.stages.base import Stage, StageContext, StageResult


def compression_tokens(ctx: StageContext) -> dict[str, int]:
    """Tokens each stage after the dense model used, from their stored results, by stage.

    A stage's count is its `tokens` metric (trained tokens; for `prune`, its calibration tokens)
    plus its `calibration_tokens` (`sparsify`) and `teacher_correction_tokens` (`distill`:
    the teacher's fine-tune) metrics where it has them.
    """
    used = {}
    for name in ctx.config.stages[: ctx.config.stages.index("control")]:
        if name == DENSE_STAGE:
            continue
        result = StageResult.load(ctx.run_dir / name)
        if result is None:
            raise RuntimeError(f"[control] the result of stage {name!r} is missing")
        m = result.metrics
        keys = ("tokens", "calibration_tokens", "teacher_correction_tokens")
        used[name] = sum(int(m.get(key, 0)) for key in keys)
    return used


def control_steps(tokens: int, cfg: ControlConfig, *, processes: int, seq_len: int) -> int:
    """Optimizer steps that train on at least `tokens` tokens (at least one step)."""
    per_step = cfg.micro_batch_size * cfg.grad_accum_steps * processes * seq_len
    return max(1, math.ceil(tokens / per_step))


class Control(Stage):
    """Train the dense model on for the compression stages' tokens and score it."""

    name: ClassVar[str] = "control"
    config: ClassVar[type] = ControlConfig
    summary: ClassVar[str] = "the dense model trained on for the same tokens"

    def run(self, ctx: StageContext) -> StageResult:
        """Count the compression stages' tokens, train the dense model that long, save it."""
        from leanlm.train.evaluate import causal_lm_loss
        from leanlm.train.model import TRAIN_DTYPE, load_model
        from leanlm.train.trainer import train

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
