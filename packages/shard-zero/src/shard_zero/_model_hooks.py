"""`model.load_state_dict()` and `model.state_dict()` on a prepared model.

The optimizer steps the fp32 masters and every step copies them back into the model, so a value
loaded into a parameter alone would be undone at the next step wherever the master is a copy
(`param_dtype`, `offload_optimizer`, stage 3). A load-state-dict pre-hook notes the state dict,
and a post-hook copies this rank's rows of every loaded trainable parameter, from the state
dict's own values (full precision), into its master. At stage 3 the pre-hook also gives every
freed unit its storage for the duration of the load (the full compute-dtype parameters, no
collective), so that torch's in-place copies write into real memory; the post-hook frees it.

At stage 3 a freed unit's parameters are placeholders (NaN, see `_units`): `model.state_dict()`
raises instead of returning them (`full_state_dict` has their values).

A forward pre-hook (first of the model's) checks that the model still has the parameters
`prepare` saw, with their shapes, dtypes and devices: `model.half()`, `model.to(device)` or
`resize_token_embeddings()` after `prepare` would otherwise be undone silently at stage 3 (the
gathers write the compute parameters back) or fail later with an unrelated shape or index error
(the masters, buckets and optimizer keep the old parameters). It raises naming the parameter;
a Parameter that is still there under another name (a parametrization registered or removed
after `prepare`, e.g. a sparsity mask) is named as renamed, with that remedy.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from shard_zero._layout import Entry
from shard_zero._shards import Shards
from shard_zero._units import Unit, Units

_RENAMED = (
    ", by name: register parametrizations (e.g. sparse_kernels' masks: `sparsify_`, a "
    "schedule) before `prepare` and keep them to the end. Adding or removing one mid-run (e.g. "
    "SparseThenDense at `dense_step`, `remove_masks_`) is not supported under shard-zero; to go "
    "dense, keep the parametrizations and fill their masks with ones instead (`for m in "
    "sparse_kernels.masks(model).values(): m.fill_(True)` on every rank: masks are buffers, "
    "which shard-zero does not shard)"
)


class ModelHooks:
    """The load/save state-dict hooks of one prepared model."""

    def __init__(self, engine: Shards, units: Units | None) -> None:
        self.engine = engine
        self.units = units
        self.reading = False  # `full_state_dict` / checkpoints: stage-3 keys are allowed
        self._loads: list[tuple[dict[str, Any], str]] = []  # (state_dict, prefix) per load
        self._given: list[Unit] = []  # stage-3 units given storage for the current load
        names: dict[int, list[str]] = {}
        for name, p in engine.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        self._names = {id(e): names[id(e.param)] for e in engine.entries}
        self._unit_of = {id(e): u for u in (units.units if units else []) for e in u.entries}
        model = engine.model
        self._signature = _signature(model)
        # frozen at `prepare`: no master, no bucket; unfreezing one later would train nothing
        self._frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        model.register_forward_pre_hook(self._check_parameters, prepend=True)
        model.register_load_state_dict_pre_hook(self._pre_load)  # type: ignore[no-untyped-call]
        model.register_load_state_dict_post_hook(self._post_load)  # type: ignore[no-untyped-call]
        if units is not None:  # torch marks the hook with an attribute: not a bound method
            model.register_state_dict_post_hook(  # type: ignore[no-untyped-call]
                functools.partial(_post_state_dict_hook, self)
            )

    @torch.compiler.disable  # type: ignore[untyped-decorator]  # run eagerly under compile
    def _check_parameters(self, module: nn.Module, args: Any) -> None:
        """Each forward: the parameters' shapes, dtypes and devices (~40 µs at 201 tensors)."""
        for (name, _, *was), now in zip(self._signature, self._params_now(), strict=True):
            if now != was:
                self._changed(f"{name!r} is {_describe(now)}, was {_describe(was)}")
        for name, p in self._frozen:
            if p.requires_grad:
                self._changed(
                    f"{name!r} requires grad, it was frozen: shard-zero trains the parameters "
                    "trainable at `prepare`, so unfreeze it before; freezing later is fine"
                )

    def check_parameters(self) -> None:
        """Each step: also the parameters' identities (a module replaced or added)."""
        now = [(name, p) for name, p in self.engine.model.named_parameters()]
        if [(n, id(p)) for n, p in now] != [(n, id(p)) for n, p, *_ in self._signature]:
            was = {n: p for n, p, *_ in self._signature}
            new = [n for n, p in now if was.get(n) is not p]
            gone = set(was) - {n for n, _ in now}
            if new:
                old = [n for n, p in was.items() if p is dict(now)[new[0]] and n != new[0]]
                if old:  # the same object, renamed: `parametrize` added or removed a layer
                    self._changed(f"{new[0]!r} is {old[0]!r} renamed", _RENAMED)
            self._changed(
                f"{new[0]!r} is a new Parameter" if new else f"{sorted(gone)[0]!r} is gone"
            )
        self._check_parameters(self.engine.model, ())

    def _params_now(self) -> list[list[Any]]:
        return [[p.shape, p.dtype, p.device] for _, p, *_ in self._signature]

    @staticmethod
    def _changed(change: str, remedy: str = "") -> None:
        raise RuntimeError(
            f"shard-zero: the model's parameters changed after `prepare` ({change}). Its "
            "masters, gradient buckets and optimizer hold the parameters `prepare` saw"
            + (
                remedy
                or ": cast, move or resize the model (`.half()`, `.to()`, "
                "`resize_token_embeddings()`, a new module) before `prepare`; "
                "`ZeroConfig(param_dtype=...)` sets the compute dtype"
            )
        )

    @contextmanager
    def allow_reading(self) -> Iterator[None]:
        """Let `model.state_dict()` return stage-3 parameters (the caller reads no values)."""
        previous, self.reading = self.reading, True
        try:
            yield
        finally:
            self.reading = previous

    # ------------------------------------------------------------------ load
    def _pre_load(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        *args: Any,
    ) -> None:
        if local_metadata.get("assign_to_params_buffers", False):
            raise ValueError(
                "`model.load_state_dict(..., assign=True)` would replace the parameters "
                "shard-zero manages (its hooks and masters keep the old ones); load with "
                "`assign=False` (the default)"
            )
        self._loads.append((state_dict, prefix))
        for unit in self.units.units if self.units else []:
            if unit.full.untyped_storage().nbytes() == 0:
                unit.give_storage()
                self._given.append(unit)

    def _post_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        state_dict, prefix = self._loads.pop()
        try:
            with torch.no_grad():
                for e in self.engine.entries:
                    value = self._loaded_value(e, state_dict, prefix)
                    if value is not None:
                        self.set_master(e, value)
        finally:
            for unit in self._given:
                unit.take_storage()
            self._given.clear()

    def _loaded_value(
        self, e: Entry, state_dict: dict[str, Any], prefix: str
    ) -> torch.Tensor | None:
        """The value `state_dict` gave `e`, or None (absent, or a shape torch reports)."""
        for name in self._names[id(e)]:
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor):
                return value.detach() if tuple(value.shape) == e.shape else None
        return None

    def set_master(self, e: Entry, value: torch.Tensor) -> None:
        """Copy this rank's rows of `value` into `e`'s master (and its host compute rows)."""
        rows = value[e.start : e.end] if e.sharded else value
        e.master.copy_(rows.reshape(e.master.shape))
        if e.host_rows is not None:  # `offload_optimizer`: the source of the next gathers
            e.host_rows.copy_(e.master)

    # ------------------------------------------------------------------ save
    def _post_state_dict(self, state_dict: dict[str, Any], prefix: str) -> None:
        if self.reading:
            return
        for e in self.engine.sharded:
            unit = self._unit_of.get(id(e))
            if unit is None or unit.full.untyped_storage().nbytes() > 0:
                continue
            name = self._names[id(e)][0]
            raise RuntimeError(
                f"shard-zero stage 3: parameter {prefix + name!r} (unit "
                f"{unit.name or '<root>'!r}) holds no data outside forward and backward, so "
                "`model.state_dict()` cannot return it; call `shard_zero.full_state_dict(model)` "
                "on every rank for the full values, or `save_checkpoint` to save and resume"
            )


def _signature(model: nn.Module) -> list[list[Any]]:
    """[name, parameter, shape, dtype, device] of every parameter, in registration order."""
    return [[name, p, p.shape, p.dtype, p.device] for name, p in model.named_parameters()]


def _describe(rest: list[Any]) -> str:
    shape, dtype, device = rest
    return f"{tuple(shape)} {str(dtype).removeprefix('torch.')} on {device}"


def _post_state_dict_hook(
    hooks: ModelHooks, module: nn.Module, state_dict: dict[str, Any], prefix: str, meta: Any
) -> None:
    """`ModelHooks._post_state_dict` as a state-dict post-hook.

    Picklable, unlike a lambda: pickling the model then reaches `Units`, which refuses with a
    message.
    """
    hooks._post_state_dict(state_dict, prefix)
