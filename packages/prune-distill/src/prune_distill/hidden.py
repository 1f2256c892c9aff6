"""Intermediate hidden-state distillation loss (Minitron arXiv 2407.14679, Sec. 3, Tables 17-18).

Student layer ``i`` is matched to teacher layer ``j`` through ``hidden_states[i + 1]`` and
``hidden_states[j + 1]`` (``output_hidden_states=True``), each compared after its model's final
norm (Minitron's "post-LN" states; transformers already normed the last one), so a last layer can
match an inner one. When widths differ, one learned ``W: d_student -> d_teacher`` (no bias),
trained with the student, maps the student states. Per token the loss is ``1 - cos(W h_s, h_t)``
(``"cosine"``, best in Minitron's Table 17) or the MSE after a parameter-free layer norm
(``"mse"``), averaged over non-padding tokens and then over pairs; math in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prune_distill.config import HiddenLossType

Norm = Callable[[torch.Tensor], torch.Tensor]


def even_layer_map(student_layers: int, teacher_layers: int) -> dict[int, int]:
    """Spread the student's layers evenly over the teacher's, last onto last.

    Student layer ``i`` maps to teacher layer ``(i + 1) * teacher_layers // student_layers - 1``;
    equal depths give the identity. For a 2-layer student of a 4-layer teacher: ``{0: 1, 1: 3}``.
    """
    for name, value in (("student_layers", student_layers), ("teacher_layers", teacher_layers)):
        if value < 1:
            raise ValueError(f"`{name}` ({value}) must be >= 1")
    return {i: (i + 1) * teacher_layers // student_layers - 1 for i in range(student_layers)}


def pruned_layer_map(teacher: nn.Module, scores: Any, target: Any) -> dict[int, int]:
    """Student layer -> the teacher layer it was cut from, for `prune(teacher, scores, target)`.

    Use it as `DistillConfig.hidden_layer_map` for a depth-pruned student, so each student layer
    is matched to the very layer it started as (the layers `prune` keeps, in order).
    """
    from prune_distill.arch import arch_of, dims_of
    from prune_distill.prune import _pick_layers

    kept = _pick_layers(dims_of(teacher, arch_of(teacher)), scores, target)
    return dict(enumerate(sorted(kept)))


def check_layer_map(
    layer_map: Mapping[int, int], student_layers: int, teacher_layers: int
) -> tuple[tuple[int, int], ...]:
    """The `(student, teacher)` pairs of `layer_map`, sorted, after checking every index."""
    if not layer_map:
        raise ValueError("`hidden_layer_map` is empty: map at least one student layer")
    bad = {
        s: t
        for s, t in layer_map.items()
        if isinstance(s, bool)
        or isinstance(t, bool)
        or not isinstance(s, int)
        or not isinstance(t, int)
        or not 0 <= s < student_layers
        or not 0 <= t < teacher_layers
    }
    if bad:
        raise ValueError(
            f"`hidden_layer_map` has out-of-range entries {bad}: keys must be student layers in "
            f"[0, {student_layers}) and values teacher layers in [0, {teacher_layers})"
        )
    return tuple(sorted(layer_map.items()))


def _shape_of(model: nn.Module, role: str) -> tuple[int, int]:
    """(layers, hidden size) from a transformers model's config."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    width = getattr(config, "hidden_size", None)
    if not isinstance(layers, int) or not isinstance(width, int):
        raise TypeError(
            f"the hidden-state loss needs `{role}.config.num_hidden_layers` and "
            f"`{role}.config.hidden_size` (a transformers model); got {type(model).__name__}"
        )
    return layers, width


class HiddenStateLoss(nn.Module):
    """Loss between matched student and teacher layer outputs, with the student->teacher map.

    Args:
        layer_map: student layer -> teacher layer (0-based decoder layers).
        student_layers: the student's number of layers.
        teacher_layers: the teacher's number of layers.
        student_hidden_size: the student's hidden size.
        teacher_hidden_size: the teacher's; if different, `projection` is a learned
            `nn.Linear(student_hidden_size, teacher_hidden_size, bias=False)`.
        kind: ``"cosine"`` or ``"mse"`` (on layer-normed states).
        final_norms: the student's and the teacher's final norm, applied to every state but the
            last layer's (which transformers returns normed already); None compares the states
            as given. The teacher's runs without gradients. They are referenced, not owned (not
            in `parameters()`).
        seed: seeds the projection's initialisation (`nn.Linear`'s, from a generator of its
            own, so the global RNG is neither read nor advanced); None draws it from torch's
            global RNG, whose state depends on everything the process ran before.
    """

    projection: nn.Linear | None

    def __init__(
        self,
        layer_map: Mapping[int, int],
        *,
        student_layers: int,
        teacher_layers: int,
        student_hidden_size: int,
        teacher_hidden_size: int,
        kind: HiddenLossType = "cosine",
        final_norms: tuple[Norm, Norm] | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if kind not in ("cosine", "mse"):
            raise ValueError(f"`hidden_loss_type` ({kind!r}) must be 'cosine' or 'mse'")
        self.pairs = check_layer_map(layer_map, student_layers, teacher_layers)
        self.kind = kind
        self.layers = (student_layers, teacher_layers)
        self._norms = final_norms  # a plain tuple: the models own these modules
        self.projection = None
        if student_hidden_size != teacher_hidden_size:
            sizes = (student_hidden_size, teacher_hidden_size)
            if seed is None:
                self.projection = nn.Linear(*sizes, bias=False)
            else:
                # nn.Linear.reset_parameters' initialisation, U(-1/sqrt(in), 1/sqrt(in)), drawn
                # from the seeded generator instead of the global RNG
                # (built on the meta device: no draw, then given uninitialised CPU storage)
                meta = nn.Linear(*sizes, bias=False, device="meta")
                self.projection = meta.to_empty(device="cpu")
                gen = torch.Generator().manual_seed(seed)
                with torch.no_grad():
                    nn.init.kaiming_uniform_(self.projection.weight, a=math.sqrt(5), generator=gen)

    @classmethod
    def between(
        cls,
        student: nn.Module,
        teacher: nn.Module,
        layer_map: Mapping[int, int] | None = None,
        *,
        kind: HiddenLossType = "cosine",
        seed: int | None = None,
    ) -> HiddenStateLoss:
        """The loss for two transformers models (`layer_map` None: `even_layer_map`).

        The models must be of a supported architecture (their final norms are looked up). The
        projection (if any) is initialised from `seed` (see the class), then moved to the
        student's device and dtype.
        """
        from prune_distill.arch import arch_of

        s_layers, s_width = _shape_of(student, "student")
        t_layers, t_width = _shape_of(teacher, "teacher")
        if layer_map is None:
            layer_map = even_layer_map(s_layers, t_layers)
        loss = cls(
            layer_map,
            student_layers=s_layers,
            teacher_layers=t_layers,
            student_hidden_size=s_width,
            teacher_hidden_size=t_width,
            kind=kind,
            seed=seed,
            final_norms=(
                student.get_submodule(arch_of(student).final_norm),
                teacher.get_submodule(arch_of(teacher).final_norm),
            ),
        )
        weight = next(student.parameters())
        return loss.to(device=weight.device, dtype=weight.dtype)

    def forward(
        self,
        student_states: Sequence[torch.Tensor],
        teacher_states: Sequence[torch.Tensor],
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mean loss over the matched pairs.

        Args:
            student_states: the student's ``hidden_states`` (layers + 1 tensors of (B, S, Ds)).
            teacher_states: the teacher's (layers + 1 tensors of (B, S, Dt)); no gradient needed.
            mask: (B, S), 0 on padding (excluded), or None.

        Returns:
            A scalar fp32 tensor.
        """
        weights = None
        if mask is not None:
            weights = mask.to(torch.float32)
            weights = weights / weights.sum().clamp_min(1.0)
        total = torch.zeros((), dtype=torch.float32, device=student_states[-1].device)
        for s, t in self.pairs:
            h_s, h_t = student_states[s + 1], teacher_states[t + 1]
            if self._norms is not None:
                if s < self.layers[0] - 1:
                    h_s = self._norms[0](h_s)
                if t < self.layers[1] - 1:
                    with torch.no_grad():
                        h_t = self._norms[1](h_t)
            if self.projection is not None:
                h_s = self.projection(h_s.to(self.projection.weight.dtype))
            h_s = h_s.float()
            h_t = h_t.to(device=h_s.device, dtype=torch.float32)
            if h_s.shape != h_t.shape:
                raise ValueError(
                    f"student layer {s} gives states of shape {tuple(h_s.shape)} but teacher "
                    f"layer {t} gives {tuple(h_t.shape)}: same batch and sequence length needed"
                )
            if self.kind == "cosine":
                per_token = 1.0 - F.cosine_similarity(h_s, h_t, dim=-1, eps=1e-6)
            else:
                width = (h_t.shape[-1],)
                per_token = (F.layer_norm(h_s, width) - F.layer_norm(h_t, width)).pow(2).mean(-1)
            total = total + (per_token.mean() if weights is None else (per_token * weights).sum())
        return total / len(self.pairs)
