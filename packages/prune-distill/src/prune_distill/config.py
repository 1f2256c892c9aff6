"""`DistillConfig` and the option types of the losses: plain Python, no torch at import.

`prune_distill.distill` uses them; they live here so that a program can build and check a
`DistillConfig` (e.g. leanlm validating a config file) without loading torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch
    from torch import nn

    OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]

HiddenLossType = Literal["cosine", "mse"]
"""Per-token hidden-state loss of `HiddenStateLoss`."""

Backend = Literal["auto", "torch", "triton"]
"""Which implementation `forward_kl` runs; see `prune_distill.losses`."""


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """How `distill` trains the student."""

    temperature: float = 1.0
    """Softmax temperature T of the KL term (the loss is scaled by T^2). Minitron: 1."""
    kl_weight: float = 1.0
    """Weight of the forward KL(teacher || student) term."""
    lm_loss_weight: float = 0.0
    """Weight of the student's next-token cross-entropy (Minitron: 0, KL only)."""
    top_k: int | None = None
    """Keep only the teacher's top-k logits (renormalised); None uses the full vocabulary.
    Minitron saw quality losses for k <= 100."""
    chunk_size: int | None = 1024
    """Token rows per chunk of the memory-lean KL; None uses plain autograd."""
    kl_backend: Backend = "auto"
    """`forward_kl` backend: "auto" (fused Triton kernel for CUDA logits and a dense teacher,
    else chunked PyTorch), "torch" or "triton"."""
    lr: float = 1e-4
    """Learning rate of the default AdamW."""
    weight_decay: float = 0.0
    """Weight decay of the default AdamW."""
    optimizer: OptimizerFactory | None = None
    """Builds the optimizer from the student's trainable parameters; None: AdamW(lr, wd)."""
    scheduler: SchedulerFactory | None = None
    """Builds an LR scheduler from the optimizer, stepped once per optimizer step."""
    grad_accumulation_steps: int = 1
    """Micro-batches per optimizer step (a trailing partial group is stepped, rescaled)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps; None runs through `batches` once."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm; None disables clipping."""
    hidden_loss_weight: float = 0.0
    """Weight of the intermediate hidden-state loss (`HiddenStateLoss`); 0 = off. Minitron found it
    helps only when depth is cut a lot (Table 17); with different hidden sizes a learned linear
    map student -> teacher width is trained with the student (`DistillResult.projection`)."""
    hidden_layer_map: Mapping[int, int] | None = None
    """Student layer -> teacher layer whose outputs are matched (0-based). None: spread the
    student's layers evenly over the teacher's, last onto last (`even_layer_map`); for a
    depth-pruned student `pruned_layer_map(teacher, scores, target)` gives the kept layers."""
    hidden_loss_type: HiddenLossType = "cosine"
    """Per-token hidden-state loss: `"cosine"` (1 - cosine similarity; Minitron's best) or
    `"mse"` (on layer-normed states)."""
    hidden_projection_seed: int | None = None
    """Seeds the initialisation of the hidden-state loss's projection (`HiddenStateLoss`'s
    `seed`), so that a run is reproducible whatever the process ran before; None draws it from
    torch's global RNG."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"`temperature` ({self.temperature}) must be > 0")
        if self.kl_weight < 0 or self.lm_loss_weight < 0:
            raise ValueError(
                f"`kl_weight` ({self.kl_weight}) and `lm_loss_weight` ({self.lm_loss_weight}) "
                "must be >= 0"
            )
        if not self.hidden_loss_weight >= 0:
            raise ValueError(f"`hidden_loss_weight` ({self.hidden_loss_weight}) must be >= 0")
        if self.kl_weight == 0 and self.lm_loss_weight == 0 and self.hidden_loss_weight == 0:
            raise ValueError(
                "`kl_weight`, `lm_loss_weight` and `hidden_loss_weight` are all 0: nothing to "
                "train on"
            )
        if self.hidden_loss_type not in ("cosine", "mse"):
            raise ValueError(
                f"`hidden_loss_type` ({self.hidden_loss_type!r}) must be 'cosine' or 'mse'"
            )
        if self.hidden_layer_map is not None:
            bad = {
                s: t
                for s, t in self.hidden_layer_map.items()
                if not (isinstance(s, int) and isinstance(t, int) and s >= 0 and t >= 0)
            }
            if bad or not self.hidden_layer_map:
                raise ValueError(
                    f"`hidden_layer_map` ({dict(self.hidden_layer_map)}) must map student layer "
                    "indices to teacher layer indices (non-negative ints), at least one pair"
                )
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"`top_k` ({self.top_k}) must be >= 1 or None")
        if self.grad_accumulation_steps < 1:
            raise ValueError(
                f"`grad_accumulation_steps` ({self.grad_accumulation_steps}) must be >= 1"
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"`max_steps` ({self.max_steps}) must be >= 1 or None")
