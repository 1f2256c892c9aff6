"""Recipes: Python functions that return a whole `RunConfig`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from leanlm.config import (
    STAGE_NAMES,
    ControlConfig,
    DataConfig,
    DistillConfig,
    ModelConfig,
    PretrainConfig,
    PruneConfig,
    RunConfig,
    SparsifyConfig,
    TokenizerConfig,
)

ALL_STAGES = STAGE_NAMES
"""Every registered stage, in pipeline order (what the demo presets run)."""


def smoke() -> RunConfig:
    """CI-sized: a ~0.2M-parameter Llama on 1.5 MB of the standard library.

    Pruned to 3/4 of its width, distilled, then 2:4 sparsified and fine-tuned; `control` trains
    the dense model on for the same tokens.
    """
    train: dict[str, Any] = {"micro_batch_size": 8, "zero_stage": 2}  # every training stage
    # `distill` and `control` (its dense baseline, trained on for as many tokens) train alike
    retrain = {"lr": 2e-3, "warmup_steps": 10, "eval_every": 50, **train}
    return RunConfig(
        name="smoke",
        stages=ALL_STAGES,
        data=DataConfig(max_bytes=1_500_000, seq_len=128, eval_windows=32),
        tokenizer=TokenizerConfig(vocab_size=2048),
        model=ModelConfig(  # 4 query and 2 KV heads (the defaults)
            hidden_size=64, intermediate_size=172, num_hidden_layers=2, max_position_embeddings=256
        ),
        pretrain=PretrainConfig(
            steps=200, lr=3e-3, warmup_steps=20, eval_every=50, checkpoint_every=50, **train
        ),
        prune=PruneConfig(hidden_size=48, intermediate_size=128, calibration_samples=32),
        distill=DistillConfig(steps=100, **retrain),
        sparsify=SparsifyConfig(steps=40, lr=1e-3, warmup_steps=5, calibration_samples=32, **train),
        control=ControlConfig(**retrain),
    )


def default() -> RunConfig:
    """The README demo: a ~5M-parameter Llama (GQA) on the whole standard library (~12 MB).

    Pretrained with CAME (ZeRO-2 across processes when there are several), pruned to 3/4 of its
    width (Minitron), distilled from the pretrained teacher, then 2:4 sparsified (Wanda) with a
    short sparse fine-tune; `control` trains the dense pretrained model on for the tokens those
    three stages used, the fair baseline for the compressed model.
    """
    # Micro-batches of 8: with 2 processes the global batch is 16 sequences (4,096 tokens).
    train: dict[str, Any] = {
        "micro_batch_size": 8,
        "eval_batch_size": 16,
        "log_every": 5,
        "zero_stage": 2,
    }
    # `distill` and `control` (its dense baseline, trained on for as many tokens) train alike
    retrain = {"lr": 2e-3, "warmup_steps": 10, "eval_every": 30, "checkpoint_every": 30, **train}
    return RunConfig(
        name="default",
        stages=ALL_STAGES,
        # fp32: bf16 autocast's speed on a CPU depends on its bf16 instructions and the model size
        data=DataConfig(seq_len=256, eval_windows=64),
        tokenizer=TokenizerConfig(vocab_size=8192),
        model=ModelConfig(),  # the defaults: 4 layers of width 256, 4 query and 2 KV heads
        pretrain=PretrainConfig(
            steps=DEFAULT_STEPS["pretrain"],
            lr=2e-3,
            warmup_steps=25,
            eval_every=90,
            checkpoint_every=45,
            **train,
        ),
        prune=PruneConfig(hidden_size=192, intermediate_size=512, calibration_samples=64),
        distill=DistillConfig(steps=DEFAULT_STEPS["distill"], **retrain),
        sparsify=SparsifyConfig(
            steps=DEFAULT_STEPS["sparsify"],
            lr=5e-4,
            warmup_steps=5,
            eval_every=30,
            checkpoint_every=15,
            calibration_samples=64,
            **train,
        ),
        control=ControlConfig(**retrain),
    )


DEFAULT_STEPS = {"pretrain": 180, "distill": 60, "sparsify": 30}
"""Optimizer steps of the `default` preset's training stages."""


PRESETS: dict[str, Callable[[], RunConfig]] = {"smoke": smoke, "default": default}
"""Presets by name (`leanlm demo --preset NAME`)."""
