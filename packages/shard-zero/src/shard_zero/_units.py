"""Stage 3: wrapping units, gathered for forward and backward and freed right after use.

A unit's parameters are views of one flat buffer (`Unit.full`) while it is gathered; at rest the
buffer's storage is resized to 0 and each parameter's `.data` is a stride-0 view of its own NaN
element (`Units._nans`): the right shape, dtype and device, no memory; reads see NaN and most
in-place writes raise, instead of reaching freed memory. Autograd keeps working across the
swap: what forward saved are views of `full`'s storage object, which the next gather resizes
back (as FSDP does), and a `.data` assignment keeps the parameter's version counter.
Gathering a unit casts the masters' rows into this rank's row of the all-gather output
(one foreach copy; the all-gather runs in place, as FSDP2's), then gives `full` its storage and
copies the rows in (one foreach copy; the output is dropped), so a prefetched unit holds only
its all-gather output until it is needed. The gathered rows are rank-major and the parameters
row-major, so (as in FSDP2) that copy is needed at world > 1; at world 1 the cast writes
straight into `full`. In forward a pre-hook gathers the unit (and prefetches the next one) and
a post-hook frees it; a hook on the gradient of every tensor in the unit's output (its
pytree: tuples, lists, dicts, `ModelOutput`s) gathers it again in backward
(prefetching the unit before it), and the gradient reducer frees it as soon as its last
gradient is packed. A backward that reads the unit's storage before that (an aux loss the
output does not depend on) gathers it through a saved-tensor hook (`_unit_saved`). The root
unit (parameters outside every wrapped module, e.g. the embeddings and the LM head) is gathered
once per forward and kept until the end of backward.

Activation checkpointing recomputes a unit's forward inside backward: the hooks see that
(`torch._C._current_graph_task_id() != -1`) and then only make sure the unit is gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from shard_zero._comm import Gather
from shard_zero._layout import Bucket, Entry, copy_pairs, make_buckets, unpack_pairs
from shard_zero._shards import Shards
from shard_zero._unit import (
    _FREE,
    _GATHERING,
    _NOT_COPYABLE,
    _READY,
    Unit,
    _default_wrap_policy,
    _shared_across_units,
    _unit_dtype,
    check_no_create_graph,
    in_backward,
)
from shard_zero._unit_progress import BackwardProgress
from shard_zero._unit_saved import SavedWatch

__all__ = ["Unit", "Units", "in_backward"]

_GRADS_OF_UNIT = 1_000_000  # + 10_000 * unit index + bucket index; a unit's gather: its index


class Units:
    """The stage-3 units of one engine: construction, gathering hooks and freeing."""

    def __init__(self, engine: Shards) -> None:
        self.engine = engine
        # called when a unit's backward begins (the engine sets the reducer's `queue_callback`)
        self.before_backward: Callable[[], None] = _nothing
        self.units: list[Unit] = []
        self.fwd_order: list[Unit] = []  # the units in the order the last forward ran them
        # called with the units whose backward is over on every rank (the engine sets the
        # reducer's `launch_done`)
        self.launch_done: Callable[[set[Unit]], None] = _nothing_done
        self.in_forward = False  # between the model's forward pre-hook and its forward hook
        self._entered_by: nn.Module | None = None  # a submodule called outside the model's
        self._fresh = True  # no forward since the last backward or step
        self.pinned = 0  # depth of `gathered()` blocks: units are not freed inside them
        # what autograd saves from a unit's storage in its forward (an aux loss's backward)
        self._saved = SavedWatch(self._pre_backward)
        self._of_module: dict[int, Unit] = {}
        # per dtype, one NaN element for each resting parameter (built in `_build`)
        self._nans: dict[torch.dtype, torch.Tensor] = {}
        self._build()
        self._progress = BackwardProgress(self.units)

    def __deepcopy__(self, memo: dict[int, Any]) -> Units:
        raise TypeError(f"copy.deepcopy {_NOT_COPYABLE}")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(f"pickling (torch.save) {_NOT_COPYABLE}")

    def placeholder_storages(self) -> list[torch.Tensor]:
        """The NaN buffers the placeholders view (memory accounting skips them)."""
        return list(self._nans.values())

    def _build(self) -> None:
        engine = self.engine
        model = engine.model
        policy = engine.config.wrap_policy or _default_wrap_policy(model)
        assigned: set[torch.Tensor] = set()
        groups: list[tuple[str, list[Entry], nn.Module]] = []
        wrapped = [
            (name, module)
            for name, module in model.named_modules()
            if module is not model and policy(name, module)
        ]
        # a parameter that modules of two units hold (a weight tied across layers, or a wrapped
        # embedding's weight tied to an unwrapped LM head) would be freed by one unit while
        # the other reads it: it goes to the root unit, kept through forward and backward
        shared = _shared_across_units(model, [name for name, _ in wrapped])
        assigned.update(shared)
        for name, module in wrapped:
            members = [
                engine.by_param[p]
                for p in module.parameters()
                if p in engine.by_param and engine.by_param[p].sharded and p not in assigned
            ]
            assigned.update(e.param for e in members)
            if members:
                groups.append((name, members, module))
        rest = [e for e in engine.sharded if e.param not in assigned or e.param in shared]
        groups = [("", rest, model), *groups]
        dtypes = [_unit_dtype(name, members) for name, members, _ in groups]
        # the placeholders: per dtype one buffer, one NaN element of its own for each entry, so
        # that a write torch lets through a stride-0 view (`fill_`, `zero_`, any write to a
        # one-element parameter) shows in no other parameter (`free_all` writes NaN again)
        counts: dict[torch.dtype, int] = {}
        for dtype, (_, members, _) in zip(dtypes, groups, strict=True):
            counts[dtype] = counts.get(dtype, 0) + len(members)
        for dtype, n in counts.items():
            self._nans[dtype] = torch.full((n,), float("nan"), dtype=dtype, device=engine.device)
        used = dict.fromkeys(counts, 0)
        for (name, members, module), dtype in zip(groups, dtypes, strict=True):
            ident = len(self.units)
            unit = Unit(
                name, members, dtype, root=module is model, ident=ident, device=engine.device
            )
            label = f"stage-3 unit {name or '<root>'!r}"
            engine.comm.names[ident] = label
            offset = 0
            for e in members:
                view = unit.full[offset : offset + e.param.numel()].view(e.shape)
                view.copy_(e.param.data)
                e.param.data = view
                unit.views.append(view)
                unit.resting.append(self._nans[dtype][used[dtype]].expand(e.shape))
                used[dtype] += 1
                offset += e.param.numel()
            unit.free()
            self.units.append(unit)
            self._of_module[id(module)] = unit
            if unit.root:
                module.register_forward_pre_hook(self._root_pre_forward)
                module.register_forward_hook(self._root_post_forward, always_call=True)
            else:
                module.register_forward_pre_hook(self._unit_pre_forward)
                module.register_forward_hook(self._unit_post_forward, always_call=True)
        self._hook_root_owners(model)
        self._make_grad_buckets(assigned)

    def _hook_root_owners(self, model: nn.Module) -> None:
        """Gather the root unit when a forward enters the model below the top (`_sub_*`).

        Hooks every submodule holding root-unit parameters (e.g. `model.model`, its
        embeddings and norm, the LM head): `model.model(...)` for a reward head or a chunked
        loss, or an encoder-decoder's `generate` calling `get_encoder()(...)`, read those
        parameters' NaN placeholders before (silently).
        """
        root = {id(e.param) for e in self.units[0].entries}
        for module in model.modules():
            if module is not model and any(id(p) in root for p in module.parameters()):
                module.register_forward_pre_hook(self._sub_pre_forward)
                module.register_forward_hook(self._sub_post_forward, always_call=True)

    def _make_grad_buckets(self, assigned: set[torch.Tensor]) -> None:
        engine = self.engine
        numel, world = engine.config.bucket_numel, engine.world
        position = {id(e): i for i, e in enumerate(engine.entries)}
        last_wrapped = max((position[id(engine.by_param[p])] for p in assigned), default=-1)
        root = self.units[0]
        tail = [e for e in root.entries if position[id(e)] > last_wrapped]
        head = [e for e in root.entries if position[id(e)] <= last_wrapped]
        tail_buckets = make_buckets(tail[::-1], numel, world)
        root.grad_buckets = tail_buckets + make_buckets(head[::-1], numel, world)
        self.root_tail = len(tail_buckets)
        for unit in self.units[1:]:
            unit.grad_buckets = make_buckets(unit.entries[::-1], numel, world)
        for u, unit in enumerate(self.units):
            label = f"stage-3 unit {unit.name or '<root>'!r}"
            for i, bucket in enumerate(unit.grad_buckets):
                bucket.ident = _GRADS_OF_UNIT + 10_000 * u + i
                engine.comm.names[bucket.ident] = f"the gradients of {label} (bucket {i})"

    def launch_order(self) -> list[Bucket]:
        """The gradient buckets in the order every rank reduces them in this backward.

        Backward runs the units in reverse forward order; the root unit's parameters registered
        after the last unit (the LM head) come first and the others (the embeddings) last.
        """
        root = self.units[0]
        units: list[Unit] = []
        for unit in [*reversed(self.fwd_order), *self.units[1:]]:
            if unit not in units:
                units.append(unit)
        order = root.grad_buckets[: self.root_tail]
        order += [b for u in units for b in u.grad_buckets]
        return order + root.grad_buckets[self.root_tail :]

    def unit_of_module(self, module: nn.Module) -> Unit:
        """The unit that `module` (a wrapped module or the model) gathers."""
        return self._of_module[id(module)]

    # ------------------------------------------------------------------ gathering
    def gather_start(self, unit: Unit) -> None:
        """Launch the all-gather of a free unit (its storage is given at `gather_wait`).

        One foreach cast-copy of the masters' rows into this rank's row of the all-gather
        output; at world 1 straight into the unit's storage (the gathered unit, no collective).
        """
        if unit.state != _FREE:
            return
        engine = self.engine
        if engine.world == 1:  # every row is here and the layouts agree: no payload, no unpack
            unit.give_storage()
            views = zip(unit.entries, unit.views, strict=True)
            pairs = [(v, engine.compute_rows(e)) for e, v in views]
            copy_pairs(pairs, from_host=engine.offload)
            unit.state = _READY
            return
        b = unit.layout
        gather = Gather(engine.comm, unit.ident, b.size, unit.full.dtype)
        pairs = [
            (gather.payload[off : off + e.local_numel], engine.compute_rows(e).reshape(-1))
            for e, off in zip(b.entries, b.offsets, strict=True)
        ]
        copy_pairs(pairs, from_host=engine.offload)
        unit.gather = gather.start()
        unit.state = _GATHERING

    def gather_wait(self, unit: Unit) -> None:
        """Make `unit`'s parameters hold their full values (gathering now if needed)."""
        self.gather_start(unit)
        if unit.state == _GATHERING:
            assert unit.gather is not None
            gather, unit.gather = unit.gather, None
            out = gather.wait()
            unit.give_storage()
            b = unit.layout
            copy_pairs(
                [
                    pair
                    for e, off, view in zip(b.entries, b.offsets, unit.views, strict=True)
                    for pair in unpack_pairs(out, off, e, view)
                ]
            )
            unit.state = _READY

    def free_all(self) -> None:
        """Free every unit (end of backward, or after a step) and reset its gradient count.

        A gather still in flight is finished and dropped (`_drop_gather`).

        The placeholders' NaN is written again: a `fill_` or `zero_` on a resting parameter
        (the in-place ops torch lets write through a stride-0 view) changes it.
        """
        self._fresh = True
        self._progress.clear()
        for unit in self.units:
            if unit.state == _GATHERING:  # prefetched for a unit the forward then skipped
                self._drop_gather(unit)
            unit.free()
            unit.grads_left = len(unit.entries)
        for nan in self._nans.values():
            nan.fill_(float("nan"))

    def _drop_gather(self, unit: Unit) -> None:
        """Finish an all-gather in flight and drop what it gathered.

        A unit prefetched in a forward that then skipped it (LayerDrop, a conditional layer)
        still holds a gather launched before the step: its next use would install the old
        values. Every rank launched it (the same forward), so every rank waits for it here.
        """
        assert unit.gather is not None
        gather, unit.gather = unit.gather, None
        gather.wait()
        unit.state = _FREE

    # ------------------------------------------------------------------ hooks
    @torch.compiler.disable  # type: ignore[untyped-decorator]  # run eagerly under compile
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self._begin_forward(new=True)

    def _begin_forward(self, new: bool) -> None:
        """Gather the root unit; a `new` forward (not a recompute) starts the forward order."""
        if new and not in_backward():
            self.fwd_order = []
            self._progress.new_forward(self.fwd_order)
            self._saved.reset()
        self._fresh = False
        self.in_forward = True
        self.gather_wait(self.units[0])

    @torch.compiler.disable  # type: ignore[untyped-decorator]  # run eagerly under compile
    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.in_forward = False  # (also when the forward raised: `always_call`)
        if in_backward() or not torch.is_grad_enabled():
            return
        # a backward that begins at the model's outputs gathers the root unit again: the end
        # of an earlier backward through the same forward (`retain_graph=True`, two forwards
        # then two backwards) freed it
        root = self.units[0]
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(  # type: ignore[no-untyped-call]
                    lambda grad, u=root: self._pre_backward(u, 0)
                )

    def _sub_pre_forward(self, module: nn.Module, args: Any) -> None:
        if self.in_forward:  # inside the model's forward (traced under compile: no break)
            return
        self._enter_below_top(module, args)

    @torch.compiler.disable  # type: ignore[untyped-decorator]  # run eagerly under compile
    def _enter_below_top(self, module: nn.Module, args: Any) -> None:
        if in_backward():  # a recompute: the root unit is kept through backward
            self.gather_wait(self.units[0])
            return
        # a forward of the model below the top, as the model's own: the first since the last
        # backward or step starts the forward order, later ones (`model.model(...)`, then
        # `model.lm_head(...)`) add to it
        self._entered_by = module
        self._begin_forward(new=self._fresh)

    def _sub_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._entered_by is not module:
            return
        self._entered_by = None
        self._root_post_forward(module, args, output)

    @torch.compiler.disable  # type: ignore[untyped-decorator]  # run eagerly under compile
    def _unit_pre_forward(self, module: nn.Module, args: Any) -> None:
        unit = self.unit_of_module(module)
        self.gather_wait(unit)
        if in_backward():  # recomputed by activation checkpointing: gathered for its backward
            return
        self.fwd_order.append(unit)
        self._saved.enter(unit, len(self.fwd_order) - 1)
        if self.engine.config.prefetch:
            index = self.units.index(unit)
            if index + 1 < len(self.units):
                self.gather_start(self.units[index + 1])

    @torch.compiler.disable  # type: ignore[untyped-decorator]  # run eagerly under compile
    def _unit_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward():  # a recompute: its backward follows at once, keep it gathered
            return
        unit = self.unit_of_module(module)
        self._saved.exit(unit)  # (also when the forward raised: `always_call`)
        if not self.pinned:
            unit.free()
        if not torch.is_grad_enabled():
            return
        position, forward = len(self.fwd_order) - 1, self._progress.forward
        # every tensor of the output's pytree (tuples, lists, dicts, `ModelOutput`s), as FSDP2
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(  # type: ignore[no-untyped-call]
                    lambda grad, u=unit, f=forward, i=position: self._output_backward(u, f, i)
                )

    def _output_backward(self, unit: Unit, forward: int, position: int) -> None:
        """The gradient of `unit`'s output at `position` of `forward` is here (`_unit_progress`).

        The units done on every rank may launch their reductions; a unit whose backward began
        already is not gathered or prefetched again.
        """
        check_no_create_graph()
        self.before_backward()
        first = self._progress.reach(unit, forward, position)
        done = self._progress.done()
        if done is not None:
            self.launch_done(done)
        if not first:
            return
        self.gather_wait(unit)
        order = self._progress.order(forward)
        if self.engine.config.prefetch and 0 < position <= len(order):
            self.gather_start(order[position - 1])

    def _pre_backward(self, unit: Unit, position: int) -> None:
        """Gather `unit` for a backward that reads it (the root's output, a saved tensor)."""
        check_no_create_graph()
        self.before_backward()
        self.gather_wait(unit)
        if self.engine.config.prefetch and 0 < position <= len(self.fwd_order):
            self.gather_start(self.fwd_order[position - 1])


def _nothing() -> None:
    pass


def _nothing_done(done: set[Unit]) -> None:
    pass
