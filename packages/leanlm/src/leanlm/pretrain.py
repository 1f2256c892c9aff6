"""Stage `pretrain`: train a Llama from scratch (or continue `init_model`) with accelerate.

The training loop is `leanlm.trainer`'s.
"""

from __future__ import annotations

from typing import ClassVar

from leanlm.model import build_model, load_model
from leanlm.stages import StageContext, StageResult, register_stage
from leanlm.trainer import causal_lm_loss, train


@register_stage
class Pretrain:
    """Train `config.model` from scratch on the run's corpus (warmup + cosine schedule)."""

    name: ClassVar[str] = "pretrain"

    def run(self, ctx: StageContext) -> StageResult:
        """Build the model from `config.model` (or load `init_model`), train it, save it."""
        if ctx.input_dir is not None:  # `init_model`: continued pretraining
            model = load_model(ctx.input_dir)
        else:
            model = build_model(
                ctx.config.model, tokenizer=ctx.resources.tokenizer, seed=ctx.config.seed
            )
        metrics = train(ctx, model, ctx.config.pretrain, causal_lm_loss)
        return StageResult(
            stage=self.name,
            config_hash=ctx.config_hash,
            model_dir=ctx.model_dir.relative_to(ctx.run_dir).as_posix(),
            metrics=metrics,
        )
