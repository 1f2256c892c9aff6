"""Stage `prune`: Minitron-style structured pruning of the previous stage's model.

Importance comes from forward passes over calibration sequences drawn (seeded) from the training
split; `prune_distill.prune` then returns a smaller model of the same transformers class, which
this stage scores on the validation windows and saves.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from leanlm.calibration import load_input_with_calibration
from leanlm.checkpoint import save_atomically
from leanlm.config import PRUNE_SIZES, PruneConfig
from leanlm.evaluate import evaluate_perplexity
from leanlm.metrics import peak_memory_mib
from leanlm.model import count_parameters
from leanlm.stages import StageContext, StageResult, register_stage
from prune_distill import PruneTarget, collect_importance, prune


def prune_target(config: PruneConfig) -> PruneTarget:
    """The `prune_distill.PruneTarget` of a stage config (0 = keep becomes None)."""
    sizes: dict[str, Any] = {name: getattr(config, name) or None for name in PRUNE_SIZES}
    return PruneTarget(**sizes, layer_metric=config.layer_metric)


@register_stage
class Prune:
    """Shrink the previous stage's model to the sizes in `config.prune`."""

    name: ClassVar[str] = "prune"

    def run(self, ctx: StageContext) -> StageResult:
        """Score importance, prune, evaluate and save (every process computes the same model)."""
        cfg = ctx.config.prune
        acc = ctx.accelerator
        start = time.perf_counter()
        model, batches = load_input_with_calibration(
            ctx, samples=cfg.calibration_samples, batch_size=cfg.calibration_batch_size
        )
        scores = collect_importance(
            model, batches, num_samples=None, layer_loss=cfg.layer_metric == "lm_loss"
        )
        student = prune(model, scores, prune_target(cfg))
        calibration_tokens = sum(b["input_ids"].numel() for b in batches)
        scoring_time = time.perf_counter() - start
        evaluation = evaluate_perplexity(
            student, ctx.resources.validation_windows, autocast=acc.autocast
        )
        acc.print(
            f"[prune] {count_parameters(model):,} -> {count_parameters(student):,} params, "
            f"validation perplexity {evaluation.perplexity:.2f}"
        )
        if acc.is_main_process:
            tokenizer = ctx.resources.tokenizer

            def write(folder: Any) -> None:
                student.save_pretrained(folder)
                tokenizer.save_pretrained(folder)

            save_atomically(ctx.model_dir, write)
        acc.wait_for_everyone()
        return StageResult(
            stage=self.name,
            config_hash=ctx.config_hash,
            model_dir=ctx.model_dir.relative_to(ctx.run_dir).as_posix(),
            metrics={
                "params": count_parameters(student),
                "tokens": calibration_tokens,
                "wall_time_s": time.perf_counter() - start,
                "tokens_per_s": calibration_tokens / scoring_time,
                "val_loss": evaluation.loss,
                "val_perplexity": evaluation.perplexity,
                "peak_rss_mib": peak_memory_mib(acc.device),
                "processes": acc.num_processes,
            },
        )
