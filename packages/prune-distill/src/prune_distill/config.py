"""`DistillConfig`, `PruneTarget` and the losses' option types: plain Python, no torch at import.

`prune_distill.distill` and `prune_distill.prune` use them; they live here so that a program
can build and check them (e.g. leanlm validating a config file) without loading torch.
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

PRUNE_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
)
"""The `PruneTarget` fields that are sizes (None keeps the model's value)."""

HiddenLossType = Literal["cosine", "mse"]
"""Per-token hidden-state loss of `HiddenStateLoss`."""

Backend = Literal["auto", "torch", "triton"]
"""Which implementation `forward_kl` runs; see `prune_distill.losses`."""

LossName = Literal["forward_kl", "reverse_kl", "jsd"]
"""The logit distillation loss; see `prune_distill.divergences`."""
LOSSES: tuple[LossName, ...] = ("forward_kl", "reverse_kl", "jsd")


def check_loss(loss: str, beta: float, *, top_k: bool) -> None:
    """Raise a ValueError naming `loss` / `beta` when they are unknown or out of range.

    With `top_k` (a teacher cut to its top-k logits) the loss must be finite on a teacher that
    has no mass outside those k tokens: forward KL and JSD with ``beta < 1`` are; reverse KL
    (and JSD at ``beta = 1``, which is reverse KL) is not, and is refused.
    """
    if loss not in LOSSES:
        raise ValueError(f"`loss` ({loss!r}) must be one of {', '.join(map(repr, LOSSES))}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
        raise ValueError(
            f"`beta` ({beta!r}) must be a number in [0, 1] (the teacher's weight in JSD's "
            "mixture: 0 = forward KL, 1 = reverse KL)"
        )
    if top_k and (loss == "reverse_kl" or (loss == "jsd" and beta == 1.0)):
        what = "`loss` ('reverse_kl')" if loss == "reverse_kl" else "`loss` ('jsd') at `beta` 1"
        raise ValueError(
            f"{what} needs the teacher's full distribution: KL(student || teacher) is infinite "
            "wherever the student has mass outside the teacher's top-k; use the dense teacher "
            "(no top-k), or 'forward_kl' / 'jsd' with `beta` < 1"
        )


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """How `distill` trains the student."""

    temperature: float = 1.0
    """Softmax temperature T of the KL term (the loss is scaled by T^2). Minitron: 1."""
    kl_weight: float = 1.0
    """Weight of the logit loss (`loss`; by default forward KL(teacher || student))."""
    lm_loss_weight: float = 0.0
    """Weight of the student's next-token cross-entropy (Minitron: 0, KL only)."""
    top_k: int | None = None
    """Keep only the teacher's top-k logits (renormalised); None uses the full vocabulary.
    Minitron saw quality losses for k <= 100."""
    chunk_size: int | None = 1024
    """Token rows per chunk of the memory-lean KL; None uses plain autograd."""
    loss: LossName = "forward_kl"
    """The logit loss (`prune_distill.divergence`): "forward_kl" KL(teacher || student)
    (Minitron's), "reverse_kl" KL(student || teacher) (not with `top_k` or cached top-k logits)
    or "jsd", the generalized Jensen-Shannon divergence with mixture weight `beta`."""
    beta: float = 0.5
    """JSD's teacher weight in the mixture ``m = beta * teacher + (1 - beta) * student``, in
    [0, 1]; 0 is forward KL, 1 reverse KL (TRL's and Liger-Kernel's convention). Only "jsd"
    reads it."""
    kl_backend: Backend = "auto"
    """Loss backend: "auto" (fused Triton kernel for CUDA logits and a dense teacher,
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
        check_loss(self.loss, self.beta, top_k=self.top_k is not None)
        if self.grad_accumulation_steps < 1:
            raise ValueError(
                f"`grad_accumulation_steps` ({self.grad_accumulation_steps}) must be >= 1"
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"`max_steps` ({self.max_steps}) must be >= 1 or None")


@dataclass(frozen=True, kw_only=True)
class PruneTarget:
    """The shape to prune to. Fields left as None keep the model's current value."""

    hidden_size: int | None = None
    """Residual width (GPT-2: ``n_embd``); must equal heads x head_dim for GPT-2 and GPT-NeoX."""
    intermediate_size: int | None = None
    """MLP neurons per layer (GPT-2: ``n_inner``)."""
    num_attention_heads: int | None = None
    """Query heads per layer; with GQA they are trimmed within each kept KV group."""
    num_key_value_heads: int | None = None
    """KV groups to keep (families with grouped-query attention); lowering it drops whole groups
    with their query heads. None keeps every group (for an MHA model: follows
    `num_attention_heads`)."""
    num_hidden_layers: int | None = None
    """Decoder layers to keep."""
    layer_metric: Literal["block_importance", "lm_loss"] = "block_importance"
    """Which layer score ranks layers for depth pruning (lowest dropped first)."""
    drop_layers: tuple[int, ...] | None = None
    """Explicit layer indices to drop instead of ranking (e.g. a contiguous block)."""

    def __post_init__(self) -> None:
        """Check what needs no model: sizes are ints >= 1, KV groups divide the heads.

        `prune` checks the rest against the model (nothing grows, whole KV groups, the family's
        own rules).
        """
        for name in PRUNE_SIZES:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"`{name}` must be an int or None, got {type(value).__name__}")
            if value < 1:
                raise ValueError(
                    f"`{name}` ({value}) must be a size >= 1 (leave it unset to keep the "
                    "model's value)"
                )
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and kv is not None and heads % kv:
            raise ValueError(
                f"`num_key_value_heads` ({kv}) must divide `num_attention_heads` ({heads})"
            )
        if self.layer_metric not in ("block_importance", "lm_loss"):
            raise ValueError(
                f"`layer_metric` ({self.layer_metric!r}) must be 'block_importance' or 'lm_loss'"
            )
