"""Stage `pretrain`: train a Llama from scratch (or continue `init_model`) with accelerate.

The training loop is `leanlm.trainer`'s.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

from leanlm.configio import ConfigError
from leanlm.sections import TrainConfig
from leanlm.stages import Stage, StageContext, StageResult, register_stage

if TYPE_CHECKING:
    from leanlm.config import RunConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainConfig(TrainConfig):
    """Stage `pretrain`: train `model` from scratch on the corpus."""


@register_stage
class Pretrain(Stage):
    """Train `config.model` from scratch on the run's corpus (warmup + cosine schedule)."""

    name: ClassVar[str] = "pretrain"
    config: ClassVar[type] = PretrainConfig
    needs_input: ClassVar[bool] = False
    summary: ClassVar[str] = "train the model"

    @classmethod
    def check_run(cls, run: RunConfig) -> None:
        """`pretrain` can only be the first stage; `[data] streaming` / `packing` feed it alone."""
        if cls.name in run.stages[1:]:
            raise ConfigError("stages", f"'pretrain' can only come first: {list(run.stages)}")
        # the other stages read the materialized training blocks (calibration, a teacher's
        # cache or correction) or train against a teacher that would not see the boundaries
        others = [s for s in run.stages if s != cls.name]
        for key in ("streaming", "packing"):
            if getattr(run.data, key) and others:
                raise ConfigError(
                    f"data.{key}",
                    f"(true) is supported for stage 'pretrain' only, but `stages` also has "
                    f"{others}: run those in a run with {key} = false",
                )

    def run(self, ctx: StageContext) -> StageResult:
        """Build the model from `config.model` (or load `init_model`), train it, save it."""
        from leanlm.evaluate import causal_lm_loss
        from leanlm.model import TRAIN_DTYPE, build_model, load_model
        from leanlm.trainer import train

        if ctx.input_dir is not None:  # `init_model`: continued pretraining
            model = load_model(ctx.input_dir, dtype=TRAIN_DTYPE)
        else:
            model = build_model(
                ctx.config.model, tokenizer=ctx.resources.tokenizer, seed=ctx.config.seed
            )
        return ctx.result(train(ctx, model, ctx.section, causal_lm_loss))
