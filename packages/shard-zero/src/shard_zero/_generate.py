"""Stage 3: Hugging Face `generate` keeps every rank's forwards in step (`synced_gpus`).

At stage 3 every forward gathers the units' parameters with the other ranks. transformers'
`GenerationMixin.generate` ends a rank's decoding loop when that rank's own sequences finish,
unless `synced_gpus` is on: then a finished rank keeps running forwards (and discards them) until
every rank has finished. transformers turns it on by itself only under DeepSpeed ZeRO-3 or FSDP,
so without it a rank whose prompts end first leaves the others waiting in their next gather.

`install` gives each `GenerationMixin` module of a stage-3 model (group of more than one rank) an
instance-level `generate` that runs with `synced_gpus=True`: absent or None silently, an explicit
False (what `Seq2SeqTrainer` passes outside DeepSpeed / FSDP) with a warning.
The synced loop decides when to stop with one all-reduce of a "still running" flag per step, in
`GenerationMixin._has_unfinished_sequences`, over the default process group; `install` replaces
that method on the instance by the same reduction over shard-zero's group, so that with a
`group` smaller than the world the ranks outside it need not call `generate` (and the flag waits
at most `ZeroConfig.timeout`, like every shard-zero collective). When transformers' method does
not have the signature this was written against, the flag stays on the default group: then
`synced_gpus` is forced on only when shard-zero's group spans the whole world.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_FLAG_METHOD = "_has_unfinished_sequences"
_FLAG_PARAMS = ["self", "this_peer_finished", "synced_gpus", "device"]


def install(model: nn.Module, group: Any, world: int, device: torch.device) -> None:
    """Run `synced_gpus=True` in the `generate` of every transformers model in `model`.

    Args:
        model: the prepared (stage-3) model; it and its submodules that derive from
            transformers' `GenerationMixin` get the instance-level methods.
        group: shard-zero's process group (what every stage-3 gather runs on).
        world: the number of ranks in `group`; nothing is installed at 1.
        device: the model's device (where `group` communicates).
    """
    mixin = _generation_mixin()
    if mixin is None or world == 1:
        return
    own_flag = _flag_signature_ok(mixin)
    if not own_flag and world != dist.get_world_size():
        return  # the flag would be all-reduced over ranks outside `group`
    for module in model.modules():
        if not isinstance(module, mixin):
            continue
        generate = getattr(type(module), "generate", None)
        if not callable(generate):
            continue
        position = _synced_gpus_position(generate)
        if position is None:
            continue  # this `generate` takes no `synced_gpus`
        synced = MethodType(_synced_generate(generate, position), module)
        module.generate = synced  # type: ignore[assignment]
        if own_flag:
            setattr(module, _FLAG_METHOD, MethodType(_group_flag(group, device), module))


def _generation_mixin() -> type | None:
    """The `GenerationMixin` of transformers; None when not imported (then no model derives it)."""
    utils = sys.modules.get("transformers.generation.utils")
    mixin = getattr(utils, "GenerationMixin", None)
    return mixin if isinstance(mixin, type) else None


def _flag_signature_ok(mixin: type) -> bool:
    """Whether `mixin._has_unfinished_sequences` takes the arguments `_group_flag` replaces."""
    method = getattr(mixin, _FLAG_METHOD, None)
    if method is None:
        return False
    try:
        return list(inspect.signature(method).parameters) == _FLAG_PARAMS
    except (TypeError, ValueError):
        return False


def _synced_gpus_position(generate: Callable[..., Any]) -> int | None:
    """Where `synced_gpus` may come positionally (after `self`): -1 keyword only, None absent."""
    try:
        params = list(inspect.signature(generate).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for i, p in enumerate(params):
        if p.name == "synced_gpus":
            return i if p.kind in positional else -1
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
        return -1  # `**kwargs`: passed on to `GenerationMixin.generate`
    return None


def _synced_generate(generate: Callable[..., Any], position: int) -> Callable[..., Any]:
    """`generate` always run with `synced_gpus=True` (same signature and docstring).

    Absent or None becomes True silently; any other value (False: what `Seq2SeqTrainer` passes
    outside DeepSpeed / FSDP) becomes True with a warning, since without it the ranks' gathers
    fall out of step as soon as one rank's sequences end before another's.
    """

    @functools.wraps(generate)
    def synced_generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if 0 <= position < len(args):
            if args[position] is not True:
                _warn_if_false(args[position])
                args = (*args[:position], True, *args[position + 1 :])
        elif kwargs.get("synced_gpus") is not True:
            _warn_if_false(kwargs.get("synced_gpus"))
            kwargs["synced_gpus"] = True
        return generate(self, *args, **kwargs)

    return synced_generate


def _warn_if_false(synced_gpus: object) -> None:
    """Warn that an explicit `synced_gpus=False` (Seq2SeqTrainer's own default) is run as True."""
    if synced_gpus is None:
        return  # None: "transformers decides", which is False outside DeepSpeed / FSDP
    warnings.warn(
        f"synced_gpus={synced_gpus!r} given to generate() of a shard-zero stage-3 model over "
        "more than one rank: running with synced_gpus=True (every forward gathers parameters "
        "with the other ranks, so a rank that stopped early would leave them waiting; "
        "transformers' Seq2SeqTrainer passes False unless DeepSpeed ZeRO-3 or FSDP is on)",
        stacklevel=3,
    )


def _group_flag(group: Any, where: torch.device) -> Callable[..., bool]:
    """`GenerationMixin._has_unfinished_sequences` reducing over `group`, not the default group.

    The flag lives on the model's device `where` (what `group`'s backend carries), whatever
    device transformers names (the inputs').
    """

    def has_unfinished_sequences(
        self: nn.Module, this_peer_finished: bool, synced_gpus: bool, device: torch.device
    ) -> bool:
        """Whether to run another decoding step: any rank of shard-zero's group still running."""
        if not synced_gpus:
            return not this_peer_finished
        running = torch.tensor(0.0 if this_peer_finished else 1.0, device=where)
        dist.all_reduce(running, op=dist.ReduceOp.SUM, group=group)
        return bool(running.item() != 0.0)

    return has_unfinished_sequences
