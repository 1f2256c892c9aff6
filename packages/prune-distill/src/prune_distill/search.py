"""Minitron's lightweight architecture search (arXiv 2407.14679, Sec. 2.3 and Table 9).

Enumerate target shapes from a small search space (depth and width choices), keep those whose
parameter count is within a budget, prune each from the same importance scores, distill each
briefly (Minitron: rankings settle after ~300 steps, Fig. 9), and rank them by validation LM loss.
"""

from __future__ import annotations

import collections
import copy
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from prune_distill._config_rules import longrope_conflict
from prune_distill.arch import arch_of, dims_of
from prune_distill.config import DistillConfig, PruneTarget
from prune_distill.distill import distill
from prune_distill.importance import (
    ImportanceScores,
    _token_nll,
    calibration_batches,
    lm_targets,
    many_batches,
    model_inputs,
)
from prune_distill.prune import prune

Batches = Iterable[Mapping[str, Any]]


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """The choices per axis; an empty tuple keeps the model's current value.

    Every combination is a candidate (those the model or its config class cannot take are
    skipped, e.g. heads not divisible by KV heads).
    """

    num_hidden_layers: tuple[int, ...] = ()
    hidden_size: tuple[int, ...] = ()
    intermediate_size: tuple[int, ...] = ()
    num_attention_heads: tuple[int, ...] = ()


@dataclass(frozen=True)
class Candidate:
    """One searched shape: its target, size and validation loss before and after distilling."""

    target: PruneTarget
    params: int
    loss_pruned: float
    """Validation LM loss right after pruning."""
    loss_distilled: float
    """Validation LM loss after the short distillation (the ranking key)."""


@dataclass
class SearchResult:
    """`search`'s ranked table (best first) and the best distilled student."""

    ranking: list[Candidate] = field(default_factory=list)
    best: Any = None
    """The distilled model of ``ranking[0]``."""

    def table(self) -> str:
        """The ranking as a Markdown table."""
        rows = [
            "| rank | layers | hidden | MLP | heads | params | val loss pruned "
            "| val loss distilled |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for i, c in enumerate(self.ranking, 1):
            t = c.target
            rows.append(
                f"| {i} | {t.num_hidden_layers} | {t.hidden_size} | {t.intermediate_size} | "
                f"{t.num_attention_heads} | {c.params:,} | {c.loss_pruned:.4f} | "
                f"{c.loss_distilled:.4f} |"
            )
        return "\n".join(rows)


def count_params(model: nn.Module) -> int:
    """Parameters of `model`, tied tensors counted once."""
    return sum(p.numel() for p in model.parameters())


def candidates(
    model: nn.Module, space: SearchSpace, params: int, tolerance: float = 0.05
) -> list[tuple[PruneTarget, int]]:
    """Every shape of `space` whose parameter count is within ``params * (1 ± tolerance)``.

    Counts come from building each pruned config on the meta device (no weights). Returned in
    enumeration order with their counts; shapes the model or its config class rejects are left
    out.
    """
    return _shapes(model, space, params, tolerance)[0]


Skip = tuple[str, str]
"""Why a shape cannot be pruned from the model: (the rule it breaks, the message)."""


def _shapes(
    model: nn.Module, space: SearchSpace, params: int, tolerance: float
) -> tuple[list[tuple[PruneTarget, int]], list[int], list[Skip]]:
    """`candidates`, the counts of every prunable shape, and why each other shape was skipped."""
    if not params > 0:
        raise ValueError(f"`params` ({params}) must be > 0")
    if not 0 <= tolerance < 1:
        raise ValueError(f"`tolerance` ({tolerance}) must be in [0, 1)")
    spec = arch_of(model)
    d = dims_of(model, spec)
    axes = {
        "num_hidden_layers": space.num_hidden_layers or (d.layers,),
        "hidden_size": space.hidden_size or (d.hidden,),
        "intermediate_size": space.intermediate_size or (d.ffn,),
        "num_attention_heads": space.num_attention_heads or (d.heads,),
    }
    for name, values in axes.items():
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise ValueError(f"`SearchSpace.{name}` ({values}) must hold positive ints")
    out: list[tuple[PruneTarget, int]] = []
    counts: list[int] = []
    rejected: list[Skip] = []
    for layers, hidden, ffn, heads in itertools.product(*axes.values()):
        target = PruneTarget(
            num_hidden_layers=layers,
            hidden_size=hidden,
            intermediate_size=ffn,
            num_attention_heads=heads,
        )
        n = _meta_params(model, spec, d, target)
        if isinstance(n, tuple):
            rejected.append(n)
            continue
        counts.append(n)
        if abs(n - params) <= tolerance * params:
            out.append((target, n))
    return out, counts, rejected


def _meta_params(model: nn.Module, spec: Any, d: Any, t: PruneTarget) -> int | Skip:
    """The parameter count of `model` pruned to `t`, or why `t` cannot be pruned from it."""
    assert t.num_attention_heads is not None
    assert t.hidden_size is not None
    assert t.num_hidden_layers is not None
    assert t.intermediate_size is not None
    sizes = {
        "hidden_size": (t.hidden_size, d.hidden),
        "num_attention_heads": (t.num_attention_heads, d.heads),
        "num_hidden_layers": (t.num_hidden_layers, d.layers),
        "intermediate_size": (t.intermediate_size, d.ffn),
    }
    for axis, (size, limit) in sizes.items():
        if size > limit:
            return "grows", f"`{axis}` ({size}) > the model's {limit} (pruning only shrinks)"
    group = d.heads // d.kv_heads
    kv = t.num_attention_heads if group == 1 else d.kv_heads
    if t.num_attention_heads % kv or t.num_attention_heads // kv > group:
        return "kv_groups", (
            f"`num_attention_heads` ({t.num_attention_heads}) must be a multiple of the "
            f"model's {kv} KV groups with at most {group} query heads per group"
        )
    if spec.head_dim_field is None and t.hidden_size != t.num_attention_heads * d.head_dim:
        return "width", (
            f"`hidden_size` ({t.hidden_size}) != `num_attention_heads` ({t.num_attention_heads}) "
            f"x head_dim ({d.head_dim}), which {spec.name} needs (its attention width is its "
            "hidden size: search both axes together)"
        )
    config: Any = copy.deepcopy(model.config)
    setattr(config, spec.hidden_field, t.hidden_size)
    setattr(config, spec.ffn_field, t.intermediate_size)
    setattr(config, spec.heads_field, t.num_attention_heads)
    setattr(config, spec.layers_field, t.num_hidden_layers)
    if spec.kv_field is not None:
        setattr(config, spec.kv_field, kv)
    if spec.head_dim_field is not None:
        setattr(config, spec.head_dim_field, d.head_dim)
    for name in spec.layer_lists:
        value = getattr(config, name, None)
        if isinstance(value, list | tuple):
            setattr(config, name, list(value)[: t.num_hidden_layers])
    try:
        type(config).from_dict(config.to_dict())
        with torch.device("meta"):
            meta = type(model)(config)
    except Exception as err:  # a shape the config class rejects is not a candidate
        hint = longrope_conflict(config, d.head_dim)
        if hint is not None:
            return "longrope", f"{type(config).__name__} rejects the shape: {hint}"
        return "config", f"{type(config).__name__} rejects the shape: {err}"
    return count_params(meta)


def _no_candidate(
    space: SearchSpace, params: int, tolerance: float, counts: list[int], rejected: list[Skip]
) -> str:
    """`search`'s error when no shape is a candidate: the budget, and why shapes were skipped."""
    total = len(counts) + len(rejected)
    if counts:
        text = (
            f"no shape of {space} has {params:,} parameters within ±{tolerance:.0%}: the "
            f"{len(counts)} prunable shapes have {min(counts):,} to {max(counts):,}; widen the "
            "search space or the tolerance"
        )
    else:
        text = f"none of the {total} shapes of {space} can be pruned from this model"
    if rejected:
        rule, times = collections.Counter(r for r, _ in rejected).most_common(1)[0]
        example = next(message for r, message in rejected if r == rule)
        text += f"; {len(rejected)} of {total} skipped, most often ({times}x) because {example}"
    return text


@torch.no_grad()
def validation_loss(model: nn.Module, batches: Batches) -> float:
    """Mean next-token loss (fp32/fp64 accumulation) of `model` on `batches`."""
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    try:
        device = next(model.parameters()).device
        for batch in calibration_batches(batches, None, device):
            nll, n = _token_nll(
                model(**model_inputs(batch), use_cache=False).logits, lm_targets(batch)
            )
            total += float(nll)
            tokens += n
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ValueError("`val_batches` yielded no target tokens")
    return total / tokens


def search(
    model: nn.Module,
    scores: ImportanceScores,
    space: SearchSpace,
    *,
    params: int,
    train_batches: Callable[[], Batches] | Sequence[Mapping[str, Any]],
    val_batches: Sequence[Mapping[str, Any]],
    tolerance: float = 0.05,
    distill_config: DistillConfig | None = None,
    layer_metric: str = "block_importance",
    max_candidates: int | None = None,
) -> SearchResult:
    """Prune `model` to every candidate shape within the budget, distill each, rank them.

    Args:
        model: the teacher (a causal LM of a supported family); not modified.
        scores: `collect_importance(model, ...)`.
        space: the choices per axis (Minitron Table 9 style).
        params: the parameter budget; candidates within ``params * (1 ± tolerance)`` are tried.
        train_batches: the distillation batches, the same for every candidate: a sequence, or
            a zero-argument callable returning a fresh iterable (e.g. a DataLoader factory).
        val_batches: batches for the validation LM loss that ranks the candidates.
        tolerance: relative budget tolerance (Minitron: ±5%).
        distill_config: how each candidate is distilled (set ``max_steps`` for a short run);
            None: `DistillConfig()`.
        layer_metric: `PruneTarget.layer_metric` for candidates that drop layers.
        max_candidates: cap on the candidates tried (in enumeration order); None tries all.

    Returns:
        The candidates ranked by validation loss after distillation (best first) and the best
        distilled model.

    Raises:
        ValueError: no candidate within the budget (the message gives the counts of the
            prunable shapes and the most common reason the others were skipped), or a bad
            argument.
    """
    given: Any
    for name, given in (("train_batches", train_batches), ("val_batches", val_batches)):
        if not callable(given) and iter(many_batches(given, name)) is given:
            raise TypeError(
                f"`{name}` is an iterator ({type(given).__name__}), used up by the first "
                "candidate: pass a list, or for `train_batches` a zero-argument callable "
                "returning a fresh iterable (e.g. a DataLoader factory)"
            )
    found, counts, rejected = _shapes(model, space, params, tolerance)
    if max_candidates is not None:
        if max_candidates < 1:
            raise ValueError(f"`max_candidates` ({max_candidates}) must be >= 1 or None")
        found = found[:max_candidates]
    if not found:
        raise ValueError(_no_candidate(space, params, tolerance, counts, rejected))
    cfg = distill_config or DistillConfig()
    result = SearchResult()
    best_loss = math.inf
    for shape, n in found:
        target = replace(shape, layer_metric=layer_metric)  # type: ignore[arg-type]
        student = prune(model, scores, target)
        before = validation_loss(student, val_batches)
        data = train_batches() if callable(train_batches) else train_batches
        distill(student, model, data, cfg)
        after = validation_loss(student, val_batches)
        result.ranking.append(Candidate(target, n, before, after))
        if after < best_loss:
            best_loss, result.best = after, student
        del student
    result.ranking.sort(key=lambda c: c.loss_distilled)
    return result
