"""Stage `pretrain`: train a Llama from scratch (or continue `init_model`) with accelerate.

The training loop is `leanlm.train.trainer`'s.
"""

from __future__ import annotations

from typing import ClassVar

from leanlm.config import PretrainConfig
from leanlm.stages.base import Stage, StageContext, StageResult


class Pretrain(Stage):
    """Train `config.model` from scratch on the run's corpus (warmup + cosine schedule)."""

    name: ClassVar[str] = "pretrain"
    config: ClassVar[type] = PretrainConfig
    summary: ClassVar[str] = "train the model"

    def run(self, ctx: StageContext) -> StageResult:
        """Build the model from `config.model` (or load `init_model`), train it, save it."""
        from leanlm.train.evaluate import causal_lm_loss
        from leanlm.train.model import TRAIN_DTYPE, build_model, load_model
        from leanlm.train.trainer import train

        if ctx.input_dir is not None:  # `init_model`: continued pretraining
            model = load_model(ctx.input_dir, dtype=TRAIN_DTYPE)
        else:
            model = build_model(
                ctx.config.model, tokenizer=ctx.resources.tokenizer, seed=ctx.config.seed
            )
        return ctx.result(train(ctx, model, ctx.section, causal_lm_loss))
