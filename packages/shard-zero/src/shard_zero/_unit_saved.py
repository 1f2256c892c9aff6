"""Stage 3: gathering a unit when backward reads it before the gradient reaches its output.

A term computed in a wrapped module's forward from its own parameters that the module's output
does not depend on (a router's load-balancing loss or a regulariser stashed on the module and
added to the loss later) has a backward that can run before the gradient reaches the module's
output, whose hook gathers the unit again: it read the freed unit (NaN parameters after the
step, or torch's "setStorage ... out of bounds" for a slice). While a unit's forward runs, a
saved-tensor hook marks what autograd saves from the unit's storage; unpacking a marked
tensor while the unit is freed gathers it (every rank runs the same backward, so the
collectives pair up), and the gradient reducer frees it as usual.

An activation checkpoint *inside* the wrapped module (timm style) keeps what it saves from
these hooks (a non-reentrant one pushes its own, innermost; a reentrant one saves nothing), and
its backward runs the checkpointed part again, reading the unit's parameters. Both save the
checkpoint's inputs first, through these hooks, and unpack them before the recompute: so any
tensor the unit's forward saved, unpacked while the unit is free and still owes gradients in
this backward (its backward has not gathered it yet), gathers it too. That gather comes early,
never extra: the unit's own backward would gather it later in the same backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._C._autograd import (  # type: ignore[attr-defined]
    _saved_tensors_hooks_is_enabled,
    _top_saved_tensors_default_hooks,
)

from shard_zero._unit import Unit

Saved = tuple[bool, Any]  # (whether it is in the unit's storage, what was packed)


class SavedWatch:
    """The saved-tensor hooks of the units whose forward is running (innermost last)."""

    def __init__(self, gather: Callable[[Unit, int], None]) -> None:
        self.gather = gather  # `gather(unit, forward position)`: the unit's backward gather
        self._stack: list[tuple[Unit, torch.autograd.graph.saved_tensors_hooks | None]] = []

    def enter(self, unit: Unit, position: int) -> None:
        """Watch what autograd saves in `unit`'s forward until `exit(unit)`.

        Saved-tensor hooks already active (non-reentrant activation checkpointing,
        `save_on_cpu`) are chained: only the innermost pair applies, so these call theirs.
        Nothing without grad or where saved-tensor hooks are disabled.
        """
        if not torch.is_grad_enabled() or not _saved_tensors_hooks_is_enabled():
            self._stack.append((unit, None))
            return
        storage = unit.full.untyped_storage()._cdata  # the same across resizes
        outer = _top_saved_tensors_default_hooks(False)

        def pack(t: torch.Tensor) -> Saved:
            # a sparse (or other non-strided) tensor has no storage of its own: not the unit's
            mine = t.layout == torch.strided and t.untyped_storage()._cdata == storage
            return mine, (t if outer is None else outer[0](t))

        def unpack(saved: Saved) -> Any:
            mine, packed = saved
            if not unit.ready and (mine or unit.grads_left > 0):
                self.gather(unit, position)
            return packed if outer is None else outer[1](packed)

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        self._stack.append((unit, hooks))

    def reset(self) -> None:
        """Leave the hooks a forward interrupted by a BaseException left behind.

        Called at the start of each model forward. The forward hooks that leave them run for an
        `Exception` only (`always_call`), not for a KeyboardInterrupt; each is left only if it
        is still the innermost pair (torch pops the top, whatever it is).
        """
        while self._stack:
            _, hooks = self._stack.pop()
            if hooks is not None and _top_saved_tensors_default_hooks(False) == (
                hooks.pack_hook,
                hooks.unpack_hook,
            ):
                hooks.__exit__(None, None, None)

    def exit(self, unit: Unit) -> None:
        """Stop watching `unit` (nothing if its `enter` did not run: a pre-hook raised)."""
        if not self._stack or self._stack[-1][0] is not unit:
            return
        _, hooks = self._stack.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)
