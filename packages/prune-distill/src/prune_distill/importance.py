"""Minitron activation-based importance, collected with forward hooks (no gradients).

Scores follow Minitron (arXiv 2407.14679, Sec. 2.2) with its chosen aggregation, mean over the
sequence then L2 over the batch (Table 11; other reductions in `prune_distill.aggregate`): heads
by the L2 norm of their attention output (or NVIDIA Model Optimizer's channel-first order), MLP
neurons by the activation entering the down projection, hidden channels by every norm's output
summed into one ranking, layers by Block Importance (ShortGPT) and the LM-loss increase when
skipped. Padding is excluded everywhere; width scores accumulate in fp64.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from prune_distill.aggregate import (
    Aggregator,
    BatchAggregation,
    SeqAggregation,
    check_aggregation,
)
from prune_distill.arch import arch_of, dims_of, layers_of, model_device

HeadOrder = Literal["paper", "modelopt"]


@dataclass(frozen=True, kw_only=True)
class ImportanceScores:
    """Importance of every prunable structure of one model (higher = more important).

    All tensors are fp32 on the CPU.
    """

    hidden: torch.Tensor
    """(hidden_size,): one score per residual channel, summed over all norm layers."""
    heads: torch.Tensor
    """(num_layers, num_attention_heads): per query head, from its attention output (the input
    of the output projection, before it mixes heads)."""
    neurons: torch.Tensor
    """(num_layers, intermediate_size): per MLP neuron, from the activation entering the down
    projection (after activation / gating, as NVIDIA's code does)."""
    block_importance: torch.Tensor
    """(num_layers,): ``1 - mean cos(layer input, layer output)`` over tokens."""
    lm_loss_increase: torch.Tensor | None
    """(num_layers,): mean token LM loss with the layer skipped minus the full model's; None when
    not collected."""
    num_samples: int
    """Sequences seen."""
    num_tokens: int
    """Non-padding tokens seen."""

    def save(self, path: str | Path) -> None:
        """Write the scores to `path` (``torch.save`` of plain tensors and ints)."""
        torch.save({f.name: getattr(self, f.name) for f in fields(self)}, path)

    @classmethod
    def load(cls, path: str | Path) -> ImportanceScores:
        """Read scores written by `save`."""
        data = torch.load(path, weights_only=True)
        return cls(**data)


def _rows(batch: Mapping[str, Any]) -> int:
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        raise ValueError("each batch must be a dict with an `input_ids` tensor of shape (B, S)")
    return int(ids.shape[0])


def _take(batch: Mapping[str, Any], rows: int, device: torch.device) -> dict[str, Any]:
    """The first `rows` sequences of `batch`, moved to `device`."""
    n = _rows(batch)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            rows_of = value[:rows] if value.dim() > 0 and value.shape[0] == n else value
            out[key] = rows_of.to(device)
        else:
            out[key] = value
    return out


def many_batches(
    batches: Iterable[Mapping[str, Any]], name: str = "batches"
) -> Iterable[Mapping[str, Any]]:
    """`batches`, refused with a `TypeError` naming `name` if it is one batch dict, not many.

    Iterating a dict gives its keys, which failed later with "'str' object has no attribute".
    """
    if isinstance(batches, Mapping):
        raise TypeError(
            f"`{name}` must be an iterable of batch dicts (e.g. a list), got one batch (a "
            f"mapping with keys {sorted(map(str, batches))}); pass `[batch]`"
        )
    return batches


def calibration_batches(
    batches: Iterable[Mapping[str, Any]], num_samples: int | None, device: torch.device
) -> Iterator[dict[str, Any]]:
    """Yield batches on `device` until `num_samples` sequences have been produced (all if None).

    Raises a ValueError naming `attention_mask` when a batch's mask is not shaped as its
    `input_ids`.
    """
    many_batches(batches)
    if num_samples is not None and num_samples < 1:
        raise ValueError(f"`num_samples` ({num_samples}) must be >= 1 or None")
    seen = 0
    for batch in batches:
        rows = _rows(batch)
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.shape != ids.shape:
            raise ValueError(
                f"`attention_mask` has shape {tuple(mask.shape)} but `input_ids` has shape "
                f"{tuple(ids.shape)}: they must be equal (B, S), 0 marking padding"
            )
        if num_samples is not None:
            rows = min(rows, num_samples - seen)
        yield _take(batch, rows, device)
        seen += rows
        if num_samples is not None and seen >= num_samples:
            return


def lm_targets(batch: Mapping[str, Any]) -> torch.Tensor:
    """Next-token targets (B, S-1) of positions 0 .. S-2; -100 marks a target not scored.

    The targets are `labels` if given, else `input_ids` with -100 on padding. A target is also
    -100 where the position predicting it is padding (``attention_mask`` 0 there), with or
    without `labels`: with left padding the first real token would otherwise be scored against
    the logits of a padding position, which an unpadded run of the same sequence never scores.
    Every LM loss here (the LM-loss layer metric, `contiguous_block_search`, `validation_loss`,
    the cross-entropy of `distill` and `correct_teacher`) uses these targets, so they do not
    depend on the padding side.
    """
    labels = batch.get("labels")
    mask = batch.get("attention_mask")
    if labels is None:
        labels = batch["input_ids"]
        if mask is not None:
            labels = labels.masked_fill(mask == 0, -100)
    assert isinstance(labels, torch.Tensor)
    targets = labels[:, 1:]
    if mask is not None:
        targets = targets.masked_fill(mask[:, :-1] == 0, -100)
    return targets


_NOT_MODEL_INPUTS = frozenset(
    {"labels", "teacher_topk_values", "teacher_topk_indices", "teacher_vocab_size"}
)  # the keys `cache_teacher_topk` adds


def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch without `labels` (losses are computed here) and cached teacher logits."""
    return {k: v for k, v in batch.items() if k not in _NOT_MODEL_INPUTS}


def _nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL (fp32) of `targets` (-100: ignored)."""
    flat = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100, reduction="sum")


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL (fp32) and the number of target tokens."""
    return _nll_sum(logits, targets), int((targets != -100).sum())


def _hidden_from(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    x = args[0] if args else kwargs["hidden_states"]
    assert isinstance(x, torch.Tensor)
    return x


def _output_tensor(output: Any) -> torch.Tensor:
    x = output[0] if isinstance(output, tuple) else output
    assert isinstance(x, torch.Tensor)
    return x


@torch.no_grad()
def collect_importance(
    model: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    *,
    num_samples: int | None = 1024,
    layer_loss: bool = True,
    seq_aggregation: SeqAggregation = "mean",
    batch_aggregation: BatchAggregation = "l2",
    head_order: HeadOrder = "paper",
    final_norm: bool = True,
) -> ImportanceScores:
    """Score heads, MLP neurons, hidden channels and layers of `model` on calibration batches.

    Forward passes only (``torch.no_grad``), in eval mode; the model's hooks, mode and weights are
    left as they were. Memory beyond the weights: one forward pass at a time (its logits are
    freed before the next; with `layer_loss`, also their fp32 loss, about 10 x vocab x tokens
    bytes per batch) and, per layer, running fp64 sums (a few vectors); activations are reduced
    in the hooks as the layer runs and never kept. Host reads happen only at the end.

    Args:
        model: a causal LM of a supported family (`prune_distill.arch.SUPPORTED`).
        batches: iterable of dicts the model accepts as keyword arguments: ``input_ids`` (B, S),
            optional ``attention_mask`` (B, S) (0 marks padding, excluded from every statistic),
            optional ``labels`` (B, S) used for the LM loss instead of ``input_ids``.
        num_samples: stop after this many sequences (Minitron uses 1024); None uses every batch.
        layer_loss: also measure the LM-loss increase when each layer is skipped (one extra
            forward pass per layer and batch).
        seq_aggregation: reduction of the width statistics over each sample's tokens: "mean"
            (Minitron's choice), "l2" or "var" (Minitron Table 11).
        batch_aggregation: reduction of the per-sample values over the samples: "l2"
            (Minitron's choice), "mean" or "var".
        head_order: "paper" scores a head by its per-token output L2 norm, then aggregates;
            "modelopt" aggregates every output channel first, then takes the L2 norm over the
            head's channels (NVIDIA Model Optimizer).
        final_norm: count the final norm's output in the hidden-channel scores (as Minitron
            and Model Optimizer count every norm); False uses the per-layer norms only.

    Returns:
        The scores; pass them to `prune`.

    Raises:
        ValueError: `batches` yields no sequence or no valid token (all padding), or an
            `attention_mask` not shaped as its `input_ids`; or a bad option.
    """
    spec = arch_of(model)
    dims = dims_of(model, spec)
    layers = layers_of(model, spec)
    device = model_device(model)
    L = dims.layers

    check_aggregation(seq_aggregation, batch_aggregation)
    if head_order not in ("paper", "modelopt"):
        raise ValueError(f"`head_order` ({head_order!r}) must be 'paper' or 'modelopt'")
    agg = (device, seq_aggregation, batch_aggregation)
    modelopt = head_order == "modelopt"
    head_acc = Aggregator(L, (dims.heads * dims.head_dim if modelopt else dims.heads,), *agg)
    neuron_acc = Aggregator(L, (dims.ffn,), *agg)
    norm_names = [f"{spec.layers}.{i}.{n}" for i in range(L) for n in spec.layer_norms]
    if final_norm:
        norm_names.append(spec.final_norm)
    hidden_acc = Aggregator(len(norm_names), (dims.hidden,), *agg)
    cos_sum = torch.zeros(L, dtype=torch.float64, device=device)
    state: dict[str, Any] = {"mask": None, "layer_in": [None] * L}

    def head_hook(i: int) -> Any:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].float()
            if modelopt:  # per channel now, L2 over each head's channels at the end
                head_acc.add(i, x.abs(), state["mask"])
            else:
                per_head = x.reshape(*x.shape[:2], dims.heads, -1).norm(dim=-1)  # (B, S, heads)
                head_acc.add(i, per_head, state["mask"])

        return hook

    def neuron_hook(i: int) -> Any:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            neuron_acc.add(i, args[0].float().abs(), state["mask"])

        return hook

    def norm_hook(j: int) -> Any:
        def hook(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
            hidden_acc.add(j, _output_tensor(output).float().abs(), state["mask"])

        return hook

    def layer_in_hook(i: int) -> Any:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            state["layer_in"][i] = _hidden_from(args, kwargs)

        return hook

    def layer_out_hook(i: int) -> Any:
        def hook(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
            x_in = state["layer_in"][i].float()
            x_out = _output_tensor(output).float()
            cos = F.cosine_similarity(x_in, x_out, dim=-1)  # (B, S)
            cos_sum[i] += (cos * state["mask"]).sum().double()
            state["layer_in"][i] = None

        return hook

    handles = []
    was_training = model.training
    model.eval()
    num_rows = 0
    # token counts stay on the device until the end: no host read per pass
    token_counts = torch.zeros(2, dtype=torch.int64, device=device)  # statistics, LM loss
    loss_base = torch.zeros((), dtype=torch.float64, device=device)
    loss_drop = torch.zeros(L, dtype=torch.float64, device=device)
    try:
        for i, layer in enumerate(layers):
            handles.append(
                layer.get_submodule(spec.attn_out).register_forward_pre_hook(head_hook(i))
            )
            handles.append(
                layer.get_submodule(spec.mlp_out).register_forward_pre_hook(neuron_hook(i))
            )
            handles.append(layer.register_forward_pre_hook(layer_in_hook(i), with_kwargs=True))
            handles.append(layer.register_forward_hook(layer_out_hook(i)))
        for j, name in enumerate(norm_names):
            handles.append(model.get_submodule(name).register_forward_hook(norm_hook(j)))

        for batch in calibration_batches(batches, num_samples, device):
            ids = batch["input_ids"]
            mask = batch.get("attention_mask")
            if mask is None:
                mask = torch.ones_like(ids)
            state["mask"] = mask.float()
            num_rows += int(ids.shape[0])
            token_counts[0] += mask.sum().long()
            # the logits (tokens x vocab, the largest tensor of a pass) are dropped as soon as
            # their loss is summed: never alive across the next forward pass
            logits = model(**model_inputs(batch), use_cache=False).logits
            if not layer_loss:
                del logits
                continue
            targets = lm_targets(batch)
            loss_base += _nll_sum(logits, targets).double()
            del logits
            token_counts[1] += (targets != -100).sum()
            loss_drop += _skipped_layer_nll(model, layers, batch, targets, state).double()
        if num_rows == 0:
            raise ValueError("`batches` yielded no sequences: nothing to calibrate on")
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)

    num_tokens, loss_tokens = (int(n) for n in token_counts)
    if num_tokens == 0:  # every score would be 0 and `prune` would keep an arbitrary slice
        raise ValueError(
            f"`batches` yielded no valid tokens (`attention_mask` is 0 on all {num_rows} "
            "sequences): nothing to calibrate on"
        )
    lm_increase = None
    if layer_loss:
        denom = max(loss_tokens, 1)
        lm_increase = ((loss_drop - loss_base) / denom).float().cpu()
    heads = head_acc.result()
    if modelopt:
        heads = heads.reshape(L, dims.heads, dims.head_dim).norm(dim=-1)
    return ImportanceScores(
        hidden=hidden_acc.result().sum(0).cpu(),
        heads=heads.cpu(),
        neurons=neuron_acc.result().cpu(),
        block_importance=(1.0 - cos_sum / max(num_tokens, 1)).float().cpu(),
        lm_loss_increase=lm_increase,
        num_samples=num_rows,
        num_tokens=num_tokens,
    )


def _skipped_layer_nll(
    model: nn.Module,
    layers: nn.ModuleList,
    batch: dict[str, Any],
    targets: torch.Tensor,
    state: dict[str, Any],
) -> torch.Tensor:
    """Summed NLL of `batch` with each layer in turn replaced by the identity, shape (L,)."""
    out = torch.zeros(len(layers), dtype=torch.float64, device=targets.device)
    # The statistic hooks must not see these passes: point them at an all-zero mask.
    mask = state["mask"]
    state["mask"] = torch.zeros_like(mask)
    try:
        for i, layer in enumerate(layers):

            def skip(
                _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
            ) -> Any:
                x = _hidden_from(args, kwargs)
                return (x, *output[1:]) if isinstance(output, tuple) else x

            handle = layer.register_forward_hook(skip, with_kwargs=True)
            try:
                logits = model(**model_inputs(batch), use_cache=False).logits
            finally:
                handle.remove()
            out[i] = _nll_sum(logits, targets).double()
            del logits  # not alive during the next pass
    finally:
        state["mask"] = mask
    return out
