"""Stage `prune`: Minitron-style structured pruning of the previous stage's model.

Importance comes from forward passes over calibration sequences drawn (seeded) from the training
split; `prune_distill.prune` then returns a smaller model of the same transformers class, which
this stage scores on the validation windows and saves. Next to the model it writes
`pruned_from.json` (`PRUNED_FROM`): the source model folder and the source layer each kept layer
was cut from, which `distill` uses to match layers in its hidden-state loss.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, ClassVar

from leanlm.calibration import load_input_with_calibration
from leanlm.checkpoint import save_atomically
from leanlm.config import PRUNE_SIZES, PruneConfig
from leanlm.evaluate import evaluate_perplexity
from leanlm.metrics import peak_memory_mib
from leanlm.model import count_parameters
from leanlm.stages import StageContext, StageResult, register_stage
from prune_distill import PruneTarget, collect_importance, prune, pruned_layer_map

PRUNED_FROM = "pruned_from.json"
"""File in the prune stage's model folder: `{"source": ..., "layer_map": {student: source}}`."""


def _path_from(run_dir: Path, path: Path) -> str:
    """`path` relative to the run folder (so a moved run still matches), else absolute."""
    return os.path.relpath(path.resolve(), run_dir.resolve())


def pruned_layer_map_for(ctx: StageContext, student_dir: Path, teacher_dir: Path) -> dict[int, int]:
    """The student layer -> teacher layer map `prune` recorded, if `teacher_dir` was its source.

    Empty when `student_dir` was not written by the prune stage or was pruned from another model.
    """
    record = student_dir / PRUNED_FROM
    if not record.is_file():
        return {}
    data = json.loads(record.read_text(encoding="utf-8"))
    if data.get("source") != _path_from(ctx.run_dir, teacher_dir):
        return {}
    return {int(s): int(t) for s, t in data["layer_map"].items()}


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
        target = prune_target(cfg)
        student = prune(model, scores, target)
        layer_map = pruned_layer_map(model, scores, target)
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

            assert ctx.input_dir is not None  # load_input_with_calibration checked it
            record = {"source": _path_from(ctx.run_dir, ctx.input_dir), "layer_map": layer_map}

            def write(folder: Any) -> None:
                student.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
                (Path(folder) / PRUNED_FROM).write_text(json.dumps(record), encoding="utf-8")

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
