"""`DistillConfig`, `PruneTarget` and the losses' option types: plain Python, no torch at import.

`prune_distill.distill` and `prune_distill.prune` use them; they live here so that a program
can build and check them (e.g. leanlm validating a config file) without loading torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import TYPE_CHECKING, Literal, get_args

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

BACKENDS: tuple[str, ...] = get_args(Backend)

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
    if not _is_real(beta) or not 0.0 <= beta <= 1.0:  # numpy scalars too
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


def _is_int(value: object) -> bool:
    """An int (or another integral type) that is not a bool."""
    return not isinstance(value, bool) and isinstance(value, Integral)


def _check_int(name: str, value: object, *, optional: bool = False) -> None:
    """Raise a ValueError naming `name` unless `value` is an int >= 1 (or None if `optional`)."""
    if optional and value is None:
        return
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        raise ValueError(
            f"`{name}` ({value!r}) must be an int >= 1" + (" or None" if optional else "")
        )


def _is_real(value: object) -> bool:
    """A real number that is not a bool or nan."""
    return not isinstance(value, bool) and isinstance(value, Real) and not math.isnan(value)


def _check_number(name: str, value: object, *, low: float, strict: bool) -> None:
    """Raise a ValueError naming `name` unless `value` is a finite number >= `low` (> if strict)."""
    ok = _is_real(value) and math.isfinite(value)  # type: ignore[arg-type]
    if not ok or value < low or (strict and value == low):  # type: ignore[operator]
        bound = f"> {low:g}" if strict else f">= {low:g}"
        raise ValueError(f"`{name}` ({value!r}) must be {bound} (a finite number)")


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
    Minitron saw quality losses for k <= 100. Not with `kl_backend` "triton" (dense only)."""
    chunk_size: int | None = 1024
    """Token rows per chunk of the memory-lean KL; None uses plain autograd (not with
    `kl_backend` "triton")."""
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
    """Micro-batches per optimizer step. Each micro-batch's losses are token sums divided by
    the valid tokens of its whole group (read from the group's masks and labels before its
    first forward), so a step equals one batch of the same sequences, whatever the padding;
    a trailing partial group is a smaller group."""
    max_steps: int | None = None
    """Stop after this many optimizer steps; None runs through `batches` once."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this value (> 0); None disables clipping."""
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
        """Check every value and combination that needs no model (errors name the field)."""
        _check_number("temperature", self.temperature, low=0.0, strict=True)
        for name in ("kl_weight", "lm_loss_weight", "hidden_loss_weight", "lr", "weight_decay"):
            _check_number(name, getattr(self, name), low=0.0, strict=False)
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
                if not (_is_int(s) and _is_int(t) and s >= 0 and t >= 0)
            }
            if bad or not self.hidden_layer_map:
                raise ValueError(
                    f"`hidden_layer_map` ({dict(self.hidden_layer_map)}) must map student layer "
                    "indices to teacher layer indices (non-negative ints), at least one pair"
                )
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"`top_k` ({self.top_k!r}) must be >= 1 (an int) or None")
        check_loss(self.loss, self.beta, top_k=self.top_k is not None)
        object.__setattr__(self, "beta", float(self.beta))  # a numpy scalar: a plain float
        _check_int("chunk_size", self.chunk_size, optional=True)
        _check_int("grad_accumulation_steps", self.grad_accumulation_steps)
        _check_int("max_steps", self.max_steps, optional=True)
        norm = self.max_grad_norm
        if norm is not None and not (_is_real(norm) and norm > 0):
            raise ValueError(
                f"`max_grad_norm` ({norm!r}) must be a number > 0, or None for no clipping"
            )
        if self.kl_backend not in BACKENDS:
            raise ValueError(
                f"`kl_backend` ({self.kl_backend!r}) must be one of "
                f"{', '.join(map(repr, BACKENDS))}"
            )
        if self.kl_backend == "triton" and self.top_k is not None:
            raise ValueError(
                f"`kl_backend` 'triton' takes the dense teacher only, but `top_k` is "
                f"{self.top_k}: use kl_backend='auto' or 'torch' (the chunked path) with `top_k`"
            )
        if self.kl_backend == "triton" and self.chunk_size is None:
            raise ValueError(
                "`kl_backend` 'triton' conflicts with `chunk_size` None (the plain autograd "
                "reference): set an int `chunk_size` (the kernel ignores it) or kl_backend='torch'"
            )


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
    """Explicit layer indices to drop instead of ranking (e.g. a contiguous block): distinct
    non-negative ints, in a tuple or list; `prune` checks them against the model's depth."""

    def __post_init__(self) -> None:
        """Check what needs no model: sizes, KV groups, `layer_metric` and `drop_layers`.

        Sizes are ints >= 1, KV groups divide the heads, `drop_layers` holds distinct
        non-negative ints. `prune` checks the rest against the model (nothing grows, whole KV
        groups, the family's own rules).
        """
        for name in PRUNE_SIZES:
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_int(value):  # an int, or another integral type (numpy's)
                raise TypeError(f"`{name}` must be an int or None, got {type(value).__name__}")
            object.__setattr__(self, name, int(value))  # frozen: stored as a plain int
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
        drop = self.drop_layers
        if drop is not None:
            if not isinstance(drop, tuple | list):
                raise TypeError(
                    f"`drop_layers` ({drop!r}) must be a tuple or list of layer indices or None, "
                    f"got {type(drop).__name__}"
                )
            if not all(_is_int(i) and i >= 0 for i in drop) or len(set(drop)) != len(drop):
                raise ValueError(
                    f"`drop_layers` ({drop!r}) must hold distinct non-negative int layer indices"
                )
