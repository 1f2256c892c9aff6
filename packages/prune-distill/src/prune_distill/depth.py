"""Depth pruning by contiguous blocks (Llama-3.1-Minitron, arXiv 2408.11796).

Instead of ranking layers one by one, try every contiguous block of ``num_drop`` layers: skip the
whole block (each of its layers returns its input) and measure the mean next-token loss on
calibration batches. The block whose removal raises the loss least is dropped. (The paper picks
the block by a downstream task, Winogrande; the LM loss is the task-free variant and what this
module measures.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from prune_distill.arch import arch_of, dims_of, layers_of, model_device
from prune_distill.importance import (
    _hidden_from,
    _token_nll,
    calibration_batches,
    lm_targets,
    model_inputs,
)


@dataclass(frozen=True)
class BlockSearch:
    """Result of `contiguous_block_search`.

    Attributes:
        drop_layers: the block to drop (pass to ``PruneTarget(drop_layers=...)``).
        loss_increase: (num_layers - num_drop + 1,) mean token LM-loss increase when the block
            starting at each index is skipped.
        base_loss: mean token LM loss of the full model.
    """

    drop_layers: tuple[int, ...]
    loss_increase: torch.Tensor
    base_loss: float


@torch.no_grad()
def contiguous_block_search(
    model: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    num_drop: int,
    *,
    num_samples: int | None = 1024,
) -> BlockSearch:
    """Find the contiguous block of `num_drop` layers whose removal costs the least LM loss.

    One forward pass per candidate block and batch, plus one for the full model; the model's
    mode and weights are left as they were.

    Args:
        model: a causal LM of a supported family.
        batches: calibration batches (``input_ids``, optional ``attention_mask`` / ``labels``).
        num_drop: layers to drop, between 1 and the number of layers minus 1.
        num_samples: stop after this many sequences; None uses every batch.

    Returns:
        The best block (ties: the earliest) and the loss increase of every block.
    """
    spec = arch_of(model)
    L = dims_of(model, spec).layers
    if isinstance(num_drop, bool) or not isinstance(num_drop, int) or not 1 <= num_drop < L:
        raise ValueError(f"`num_drop` ({num_drop!r}) must be an int between 1 and {L - 1}")
    layers = layers_of(model, spec)
    starts = L - num_drop + 1
    base = torch.zeros((), dtype=torch.float64)
    dropped = torch.zeros(starts, dtype=torch.float64)
    tokens = 0
    was_training = model.training
    model.eval()
    try:
        for batch in calibration_batches(batches, num_samples, model_device(model)):
            targets = lm_targets(batch)
            nll, count = _token_nll(model(**model_inputs(batch), use_cache=False).logits, targets)
            base += nll.double().cpu()
            tokens += count
            for start in range(starts):
                handles = [
                    layers[i].register_forward_hook(_skip, with_kwargs=True)
                    for i in range(start, start + num_drop)
                ]
                try:
                    logits = model(**model_inputs(batch), use_cache=False).logits
                finally:
                    for handle in handles:
                        handle.remove()
                dropped[start] += _token_nll(logits, targets)[0].double().cpu()
                del logits  # not alive during the next pass
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ValueError("`batches` yielded no target tokens: nothing to measure the loss on")
    increase = ((dropped - base) / tokens).float()
    best = int(torch.argmin(increase))  # the first minimum
    return BlockSearch(
        drop_layers=tuple(range(best, best + num_drop)),
        loss_increase=increase,
        base_loss=float(base / tokens),
    )


def _skip(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    x = _hidden_from(args, kwargs)
    return (x, *output[1:]) if isinstance(output, tuple) else x
