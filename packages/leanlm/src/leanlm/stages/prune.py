"""Stage `prune`: Minitron-style structured pruning of the previous stage's model.

Importance comes from forward passes over seeded calibration sequences of the training split;
`prune_distill.prune` returns a smaller model of the same transformers class, scored on the
validation windows and saved with the lineage record (`leanlm.stages.lineage`) that `distill`
uses to match layers. With `search = true` the target shape is searched (`prune_distill.search`):
every shape of the `search_*` choices within the budget is pruned, briefly distilled and ranked
by validation loss; the best is pruned from the same scores and saved undistilled.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from leanlm.config import SEARCHED, ConfigError, PruneConfig
from leanlm.stages.base import Stage, StageContext, StageResult
from leanlm.stages.lineage import write_lineage

if TYPE_CHECKING:
    from prune_distill import ImportanceScores, PruneTarget, SearchResult


class Prune(Stage):
    """Shrink the previous stage's model to the sizes in `config.prune`."""

    name: ClassVar[str] = "prune"
    config: ClassVar[type] = PruneConfig
    summary: ClassVar[str] = "structured pruning"

    def run(self, ctx: StageContext) -> StageResult:
        """Score importance, prune, evaluate and save (every process computes the same model)."""
        from leanlm.stages.calibration import load_input_with_calibration
        from leanlm.train.checkpoint import save_model_folder
        from leanlm.train.evaluate import evaluate_validation
        from leanlm.train.model import TRAIN_DTYPE, count_parameters
        from prune_distill import collect_importance, prune, pruned_layer_map

        cfg: PruneConfig = ctx.section
        acc = ctx.accelerator
        start = time.perf_counter()
        # scoring runs forward passes only: the checkpoint's dtype (bf16 halves an 8B model),
        # and the pruned model is saved in it; a search trains its candidates, so fp32 then
        model, batches = load_input_with_calibration(ctx, dtype=TRAIN_DTYPE if cfg.search else None)
        scores = collect_importance(
            model, batches, num_samples=None, layer_loss=cfg.layer_metric == "lm_loss"
        )
        target, notes, extra = cfg.target, [], {}
        tokens = sum(b["input_ids"].numel() for b in batches)
        if cfg.search:
            result, search_tokens = _search(ctx, cfg, model, scores)
            target = result.ranking[0].target
            notes = _search_notes(cfg, result)
            extra = {"search": _search_rows(result), "search_tokens": search_tokens}
            tokens += search_tokens
        student = prune(model, scores, target)
        layer_map = pruned_layer_map(model, scores, target)
        scoring_time = time.perf_counter() - start
        # at the calibration batch size: the input model is still held (`leanlm plan` plans it)
        evaluation = evaluate_validation(ctx, student, batch_size=cfg.calibration_batch_size)
        acc.print(
            f"[prune] {count_parameters(model):,} -> {count_parameters(student):,} params, "
            f"validation perplexity {evaluation.perplexity:.2f}"
        )
        source = ctx.input_dir
        assert source is not None  # load_input_with_calibration checked it

        def save(folder: Path) -> None:
            student.save_pretrained(folder)
            write_lineage(folder, ctx.run_dir, source, layer_map)

        save_model_folder(ctx, save)
        return ctx.result(
            {
                "params": count_parameters(student),
                "tokens": tokens,
                "wall_time_s": time.perf_counter() - start,
                "tokens_per_s": tokens / scoring_time,
                "val_loss": evaluation.loss,
                "val_perplexity": evaluation.perplexity,
                "processes": acc.num_processes,
                **extra,
            },
            notes=notes,
        )


def _search(
    ctx: StageContext, cfg: PruneConfig, model: Any, scores: ImportanceScores
) -> tuple[SearchResult, int]:
    """Run `prune_distill.search` on `model`; the ranking (main process's) and tokens trained.

    The candidates distill on `search_steps` seeded batches of training sequences and are
    ranked by the loss on the run's validation windows.

    Raises:
        ConfigError: `prune.search_params` when no shape of the space is within the budget.
    """
    import torch
    from accelerate.utils import broadcast_object_list

    import prune_distill
    from prune_distill.search import candidates, count_params

    space, budget, tol = cfg.search_space, cfg.search_params, cfg.search_tolerance
    # Every shape of the space (a pruned shape has at most the model's parameters).
    shapes = candidates(model, space, params=count_params(model), tolerance=1 - 1e-9)
    if not any(abs(n - budget) <= tol * budget for _, n in shapes):
        counts = sorted(n for _, n in shapes)
        found = f"from {counts[0]:,} to {counts[-1]:,}" if counts else "none valid"
        raise ConfigError(
            "prune.search_params",
            f"({budget:,}): no shape of the search space has a parameter count within "
            f"±{tol:.0%} of it (its {len(counts)} valid shapes have {found}); change the "
            "budget, the `search_*` choices or `search_tolerance`",
        )
    device = next(model.parameters()).device
    train = ctx.resources.train_blocks
    gen = torch.Generator().manual_seed(ctx.config.seed + 1)  # not the calibration draw
    picks = torch.randint(
        0, train.shape[0], (cfg.search_steps, cfg.search_batch_size), generator=gen
    )
    train_batches = [{"input_ids": train[p].to(device)} for p in picks]
    windows = ctx.resources.validation_windows
    val_batches = [
        {"input_ids": windows[i : i + cfg.search_batch_size].to(device)}
        for i in range(0, windows.shape[0], cfg.search_batch_size)
    ]
    result = prune_distill.search(
        model,
        scores,
        space,
        params=budget,
        tolerance=tol,
        train_batches=train_batches,
        val_batches=val_batches,
        distill_config=prune_distill.DistillConfig(lr=cfg.search_lr, max_steps=cfg.search_steps),
        layer_metric=cfg.layer_metric,
        max_candidates=cfg.search_max_candidates or None,
    )
    result.best = None  # the stage saves the undistilled pruned model of the best shape
    # Every process ran the same search; the main process's ranking decides for all of them.
    result.ranking = broadcast_object_list([result.ranking])[0]
    tokens = len(result.ranking) * sum(b["input_ids"].numel() for b in train_batches)
    return result, tokens


def _shape(target: PruneTarget) -> str:
    return (
        f"{target.num_hidden_layers} layers, hidden {target.hidden_size}, MLP "
        f"{target.intermediate_size}, {target.num_attention_heads} heads"
    )


def _search_notes(cfg: PruneConfig, result: SearchResult) -> list[str]:
    """One sentence for the search, then one per candidate (best first)."""
    best = result.ranking[0]
    notes = [
        f"architecture search: {len(result.ranking)} shape(s) within ±{cfg.search_tolerance:.0%} "
        f"of {cfg.search_params:,} parameters, each distilled {cfg.search_steps} steps "
        f"(batch {cfg.search_batch_size}, lr {cfg.search_lr:g}) and ranked by validation loss; "
        f"chosen: {_shape(best.target)} ({best.params:,} params), saved undistilled."
    ]
    for i, c in enumerate(result.ranking, 1):
        notes.append(
            f"search rank {i}: {_shape(c.target)}, {c.params:,} params, validation loss "
            f"{c.loss_pruned:.4f} pruned, {c.loss_distilled:.4f} distilled."
        )
    return notes


def _search_rows(result: SearchResult) -> list[dict[str, Any]]:
    """The ranking as plain data for `result.json` (best first)."""
    return [
        {
            **{name: getattr(c.target, name) for name in SEARCHED},
            "params": c.params,
            "val_loss_pruned": c.loss_pruned,
            "val_loss_distilled": c.loss_distilled,
        }
        for c in result.ranking
    ]
