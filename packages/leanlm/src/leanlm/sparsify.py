"""Stage `sparsify`: one-shot pruning (sparse-kernels), then a short sparse fine-tune.

The previous stage's model is pruned in place by `sparse_kernels.sparsify_` (default: 2:4 with
Wanda scores from calibration sequences of the training split) on every Linear of the decoder
blocks; the masks are parametrizations, so they hold through the optimizer's steps (weight
decay and momentum included) and through checkpoints. The one-shot perplexity is measured
before the fine-tune. The output folder is `sparse_kernels.save_pretrained_sparse`'s: the model
with zeros baked in (plain `from_pretrained` works) plus the bit-packed masks; the compact
format (`save_compressed`) is written next to it and its size reported.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar

import torch

from leanlm.calibration import load_input_with_calibration
from leanlm.config import SparsifyConfig
from leanlm.evaluate import evaluate_perplexity
from leanlm.metrics import peak_memory_mib, reset_peak_memory
from leanlm.model import count_parameters, load_model
from leanlm.stages import StageContext, StageResult, register_stage
from leanlm.trainer import causal_lm_loss, train
from sparse_kernels import (
    SparsityConfig,
    save_compressed,
    save_pretrained_sparse,
    sparsify_,
    sparsity_report,
)

COMPRESSED_FILE = "compressed.safetensors"


def sparsity_config(cfg: SparsifyConfig) -> SparsityConfig:
    """The `sparse_kernels.SparsityConfig` of a stage config."""
    return SparsityConfig(
        pattern=cfg.pattern, method=cfg.method, sparsity=cfg.sparsity, block_size=cfg.block_size
    )


def _save_sparse(
    model: torch.nn.Module, folder: Path, state_dict: dict[str, torch.Tensor] | None
) -> None:
    save_pretrained_sparse(model, folder)


@register_stage
class Sparsify:
    """Prune the previous stage's model one-shot, fine-tune it sparse, save it."""

    name: ClassVar[str] = "sparsify"

    def run(self, ctx: StageContext) -> StageResult:
        """Mask, score the one-shot model, fine-tune with masks held, save both formats."""
        cfg: SparsifyConfig = ctx.config.sparsify
        acc = ctx.accelerator
        start = time.perf_counter()
        reset_peak_memory(acc.device)
        model, batches = load_input_with_calibration(
            ctx, samples=cfg.calibration_samples, batch_size=cfg.calibration_batch_size
        )
        # Deterministic given the calibration batches: a resumed run rebuilds the same masks
        # before its checkpoint restores the fine-tuned weights.
        sparsify_(model, sparsity_config(cfg), calibration=batches)
        report = sparsity_report(model)
        target = sum(model.get_submodule(n).weight.numel() for n in report)
        zeros = sum(frac * model.get_submodule(n).weight.numel() for n, frac in report.items())
        one_shot = evaluate_perplexity(
            model, ctx.resources.validation_windows, autocast=acc.autocast
        )
        acc.print(
            f"[sparsify] {cfg.pattern} {cfg.method}: {len(report)} Linears, "
            f"{zeros / target:.1%} of their weights zero; one-shot validation perplexity "
            f"{one_shot.perplexity:.2f}"
        )
        metrics: dict[str, Any]
        if cfg.steps:
            metrics = train(ctx, model, cfg, causal_lm_loss, save=_save_sparse)
        else:
            metrics = _save_one_shot(ctx, model, one_shot)
        final = load_model(ctx.model_dir)
        if acc.is_main_process:
            from sparse_kernels import load_masks_

            load_masks_(final, ctx.model_dir)  # the compact format needs the masks attached
            tmp = ctx.stage_dir / f".tmp-{COMPRESSED_FILE}"
            save_compressed(final, tmp)
            tmp.replace(ctx.stage_dir / COMPRESSED_FILE)
        acc.wait_for_everyone()
        metrics.update(
            {
                "wall_time_s": time.perf_counter() - start,
                "one_shot_val_perplexity": one_shot.perplexity,
                "masked_sparsity": zeros / target,
                "compressed_bytes": (ctx.stage_dir / COMPRESSED_FILE).stat().st_size,
                "peak_rss_mib": max(metrics.get("peak_rss_mib", 0.0), peak_memory_mib(acc.device)),
            }
        )
        return StageResult(
            stage=self.name,
            config_hash=ctx.config_hash,
            model_dir=ctx.model_dir.relative_to(ctx.run_dir).as_posix(),
            metrics=metrics,
        )


def _save_one_shot(ctx: StageContext, model: torch.nn.Module, evaluation: Any) -> dict[str, Any]:
    from leanlm.checkpoint import save_atomically

    acc = ctx.accelerator
    if acc.is_main_process:
        tokenizer = ctx.resources.tokenizer

        def write(folder: Path) -> None:
            save_pretrained_sparse(model, folder)
            tokenizer.save_pretrained(folder)

        save_atomically(ctx.model_dir, write)
    acc.wait_for_everyone()
    return {
        "params": count_parameters(model),
        "tokens": 0,
        "val_loss": evaluation.loss,
        "val_perplexity": evaluation.perplexity,
        "processes": acc.num_processes,
    }
