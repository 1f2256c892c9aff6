"""Autocast without its weight cache, where no backward needs the cached copies."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def uncached_casts() -> Iterator[None]:
    """Inside autocast: cast each weight where it is used, without keeping the copy.

    Autocast caches the low-precision copy of every trainable fp32 weight until its region
    ends, for the backward. A validation forward has no backward, and a checkpointed layer
    recomputes its casts in it: there the cache would only hold a bf16 copy of every layer at
    once (7.5 GB for the 8B recipe's 4.5B-parameter student).
    """
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


def uncache_layers(model: torch.nn.Module) -> None:
    """Run every checkpointed decoder layer of `model` under `uncached_casts`.

    A module forward hook pair, outside the layer's `forward` (which transformers wraps in the
    checkpoint and leanlm may compile). `torch.utils.checkpoint` records the cache setting at
    entry, so the recomputation in the backward runs uncached too.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.register_forward_pre_hook(_stop_caching)
            module.register_forward_hook(_restore_caching, always_call=True)


_SAVED: list[bool] = []  # the cache setting before each layer call now running


def _stop_caching(module: torch.nn.Module, args: object) -> None:
    _SAVED.append(torch.is_autocast_cache_enabled())
    torch.set_autocast_cache_enabled(False)


def _restore_caching(module: torch.nn.Module, args: object, output: object) -> None:
    torch.set_autocast_cache_enabled(_SAVED.pop())
