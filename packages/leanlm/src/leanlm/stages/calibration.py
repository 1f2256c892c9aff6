"""The input of the stages that score a trained model: the model and its calibration batches."""

from __future__ import annotations

from typing import Any

import torch

from leanlm.stages.base import StageContext
from leanlm.train.model import load_model


def calibration_batches(
    blocks: torch.Tensor, *, samples: int, batch_size: int, seed: int, device: torch.device
) -> list[dict[str, torch.Tensor]]:
    """`samples` training sequences (a seeded random choice) as model-kwarg batches."""
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(blocks.shape[0], generator=gen)[:samples]
    return [
        {"input_ids": blocks[chosen[i : i + batch_size]].to(device)}
        for i in range(0, chosen.numel(), batch_size)
    ]


def load_input_with_calibration(
    ctx: StageContext, *, dtype: torch.dtype | None = None
) -> tuple[Any, list[dict[str, torch.Tensor]]]:
    """The previous stage's model (on this process's device) and calibration batches.

    The model is in `dtype`, or in its checkpoint's dtype when None
    (`leanlm.train.model.load_model`). The stage's section gives the batches:
    `calibration_samples` sequences in batches of `calibration_batch_size`.

    The batches are the same on every process and in every run with the same seed, so a stage
    that derives something from them (importance scores, masks) derives it identically.

    Raises:
        ValueError: the stage is the first one (there is no previous model).
    """
    if ctx.input_dir is None:
        raise ValueError(f"the `{ctx.stage_dir.name}` stage needs a previous stage's model")
    device, cfg = ctx.accelerator.device, ctx.section
    batches = calibration_batches(
        ctx.resources.train_blocks,
        samples=cfg.calibration_samples,
        batch_size=cfg.calibration_batch_size,
        seed=ctx.config.seed,
        device=device,
    )
    return load_model(ctx.input_dir, dtype=dtype).to(device), batches
