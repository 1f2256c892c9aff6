"""What the simulator measures: live bytes by category (a MemTracker) and collectives.

`StepTracker` is torch's `MemTracker` with the categories the report needs. MemTracker labels a
storage when it first sees it (parameters and buffers of modules as they run, tensors made in
forward as activations, in backward as temporaries, in the optimizer step as optimizer state);
on top of that:

* the fp32 master shards (shard-zero's masters, FSDP2's sharded parameters under mixed
  precision) are pinned as `masters` whenever they are not the compute parameters themselves;
* host-memory buffers (shard-zero's `offload_accum` accumulators; with `offload_optimizer` the
  masters, their gradients, the optimizer state and the compute-dtype rows) are pinned as
  `host`: tracked, but left out of the device total (`total`, the timeline and the peak); so
  are the tensors made while an optimizer steps on the host (`on_host`);
* gradients are re-labelled as `grads` before every new peak is recorded (they are created as
  backward temporaries and only then attached as `.grad`);
* tensors made inside the optimizer step start as temporaries; the optimizer's state is
  re-labelled after the step (MemTracker's own hook);
* buffers that go through a collective are labelled temporaries (communication buffers);
* every dispatched op appends the live total to a timeline, and the largest value every
  category reaches is kept (`category_max`), besides the breakdown at the overall peak.

`CollectiveCounter` is a dispatch mode that counts the `c10d` collectives (calls and bytes per
kind: the full gathered / pre-scatter / reduced buffer, the convention of the ZeRO paper's 2Ψ /
3Ψ) and records when each runs relative to backward's matmuls. It also counts the copies into
and out of the tracker's `host` storages (`to_host` / `from_host`: the host side's bytes), the
transfers an offloaded accumulator costs. Nothing is computed: under the fake process group
every collective returns at once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _UpdateType
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MASTERS = "Master"
HOST = "Host"
CATEGORIES: dict[str, Any] = {
    "params": _MemRefType.PARAM,
    "masters": MASTERS,
    "grads": _MemRefType.GRAD,
    "optimizer state": _MemRefType.OPT,
    "activations": _MemRefType.ACT,
    "temporaries": _MemRefType.TEMP,
    "other": _MemRefType.OTH,
    "buffers": _MemRefType.BUFFER,
    "host": HOST,
}
_PINNED = (MASTERS, HOST)


def _storages(t: torch.Tensor) -> list[Any]:
    if hasattr(t, "to_local"):
        t = t.to_local()  # a DTensor: its local shard
    return [t.untyped_storage()]


class StepTracker(MemTracker):  # type: ignore[no-untyped-call]
    """MemTracker with `masters` and `host` pinned, gradients re-labelled and a timeline.

    Args:
        masters: fp32 master tensors to label `masters` (skip those that are parameters).
        grads: returns the current gradient tensors (called before each new peak is recorded).
        host: tensors in host memory, labelled `host` and left out of the device total.
    """

    def __init__(
        self,
        masters: Iterable[torch.Tensor],
        grads: Callable[[], Iterable[torch.Tensor | None]],
        host: Iterable[torch.Tensor] = (),
    ) -> None:
        super().__init__()
        self._ref_class = [*_MemRefType, *_PINNED]  # type: ignore[assignment]
        self._pinned: dict[int, Any] = {}
        for label, tensors in ((MASTERS, masters), (HOST, host)):
            # the storage is kept too, so that its id is not reused while tracking
            self._pinned.update({id(st): (label, st) for t in tensors for st in _storages(t)})
        self._grads = grads
        self.timeline: list[int] = []
        self.marks: list[tuple[str, int]] = []
        self.category_max: dict[Any, int] = defaultdict(int)
        self._best = 0
        self._on_host = False

    def mark(self, phase: str) -> None:
        """Record that `phase` ("forward", "backward", "step") starts here; label gradients."""
        self.label([g for g in self._grads() if g is not None], _MemRefType.GRAD)
        self._record_maxima()  # a relabel alone dispatches no op (e.g. the end of backward)
        self.marks.append((phase, len(self.timeline)))

    def _record_maxima(self) -> None:
        snap = next(iter(self._curr_mem_snap.values()), None)
        for key, value in (snap or {}).items():
            self.category_max[key] = max(self.category_max[key], value)

    def _update_and_maybe_create_winfos(
        self, t: torch.Tensor, reftype: Any, update_existing: bool = False
    ) -> Any:
        if t is None:  # MemTracker's grad hook, after shard-zero moved the gradient away
            return set()  # type: ignore[unreachable]
        pinned = [self._pinned[id(st)][0] for st in _storages(t) if id(st) in self._pinned]
        if pinned:
            reftype = pinned[0]
        return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

    def on_host(self, on: bool) -> None:
        """Label the tensors made from now on (`on`: an optimizer step on the host) `host`."""
        self._on_host = on

    @property
    def stepping_on_host(self) -> bool:
        """Whether an optimizer is stepping on the host now (see `on_host`)."""
        return self._on_host

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        # tensors created inside the optimizer step are temporaries until the post-step hook
        # re-labels the optimizer's state
        if self._on_host:
            reftype = HOST
        super()._track(_MemRefType.TEMP if reftype == _MemRefType.OPT else reftype, t)

    def label(
        self, tensors: Iterable[torch.Tensor], reftype: Any, *, only_from: Any = None
    ) -> None:
        """Label the (already tracked) storages of `tensors` as `reftype`.

        Pinned storages (masters, host) keep their label; with `only_from`, only storages
        labelled that are changed.
        """
        for t in tensors:
            for st in _storages(t):
                entry = self._WINFO.get(st)  # type: ignore[no-untyped-call]
                if entry is None or entry[0].reftype == reftype or entry[0].reftype in _PINNED:
                    continue
                if only_from is None or entry[0].reftype == only_from:
                    old = entry[0].reftype
                    entry[0].reftype = reftype
                    self._update_snap(_UpdateType.REF, entry[0], old_reftype=old)

    def is_host(self, t: object) -> bool:
        """Whether `t` is a tensor in one of the `host` storages."""
        if not isinstance(t, torch.Tensor):
            return False
        return any(self._pinned.get(id(st), ("",))[0] == HOST for st in _storages(t))

    def on_collective(self, tensors: list[torch.Tensor]) -> None:
        """Label a collective's buffers as temporaries (if made in forward), refresh gradients."""
        self.label(tensors, _MemRefType.TEMP, only_from=_MemRefType.ACT)
        self.label([g for g in self._grads() if g is not None], _MemRefType.GRAD)

    def _update_peak_stats(self, peak_state: Any) -> None:
        # one device (the fake CPU device); no per-module peaks (not needed, and costly)
        snap = next(iter(self._curr_mem_snap.values()), None)
        total = snap[_TOTAL_KEY] - snap.get(HOST, 0) if snap is not None else 0
        self.timeline.append(total)
        if snap is None:
            return
        self._record_maxima()
        if total > self._best:
            self.label([g for g in self._grads() if g is not None], _MemRefType.GRAD)
            self._best = total
            for dev, dev_snap in self._curr_mem_snap.items():
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(dev_snap)

    def peak(self) -> dict[str, int]:
        """The breakdown at the overall (device) peak, by report category (plus `total`)."""
        snap = next(iter(self._peak_mem_snap.values()), {})
        out = {name: int(snap.get(key, 0)) for name, key in CATEGORIES.items()}
        out["total"] = int(snap.get(_TOTAL_KEY, 0)) - out["host"]
        return out

    def maxima(self) -> dict[str, int]:
        """The largest value each category reached during the step (not simultaneous)."""
        return {name: int(self.category_max.get(key, 0)) for name, key in CATEGORIES.items()}


_KINDS = {
    "allgather": "all_gather",
    "_allgather_base": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "broadcast": "broadcast",
}
_COPIES = {"copy_", "_to_copy"}
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu"}


@dataclass
class CommLog:
    """Collectives of one step: totals per kind and their timing relative to backward."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # (op index, kind, bytes, in backward, phase, live bytes just before)
    events: list[tuple[int, str, int, bool, str, int]] = field(default_factory=list)
    backward_matmuls: list[int] = field(default_factory=list)  # op indices

    def overlap(self) -> float:
        """Fraction of backward's matmuls that run after the first gradient reduction started.

        0 means every reduction waited for the end of backward (no overlap).
        """
        firsts = [e[0] for e in self.events if e[3] and e[1] == "reduce_scatter"]
        if not firsts or not self.backward_matmuls:
            return 0.0
        after = sum(1 for op in self.backward_matmuls if op > firsts[0])
        return after / len(self.backward_matmuls)


class CollectiveCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts `c10d` collectives (calls and bytes per kind) and backward matmuls, in order."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.log = CommLog()
        self.tracker: StepTracker | None = None  # labels buffers, gives phase and live bytes
        self._ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self._ops += 1
        packet = func._schema.name.split("::")
        in_bw = torch._C._current_graph_task_id() != -1
        if packet[0] == "c10d":
            kind = _KINDS.get(packet[1].rstrip("_"))
            if kind is not None:
                # all-gather: the gathered outputs (args[0]); reduce-scatter: the inputs
                # (args[1]); all-reduce / broadcast: the tensors (args[0])
                main = args[1] if kind == "reduce_scatter" else args[0]
                tensors = [t for t in tree_flatten(main)[0] if isinstance(t, torch.Tensor)]
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
                self.log.calls[kind] += 1
                self.log.bytes[kind] += nbytes
                phase, live = "", 0
                if self.tracker is not None:
                    every = tree_flatten((args, kwargs))[0]
                    self.tracker.on_collective([t for t in every if isinstance(t, torch.Tensor)])
                    phase = self.tracker.marks[-1][0] if self.tracker.marks else ""
                    live = self.tracker.timeline[-1] if self.tracker.timeline else 0
                self.log.events.append((self._ops, kind, nbytes, in_bw, phase, live))
        elif in_bw and packet[1] in _MATMULS:
            self.log.backward_matmuls.append(self._ops)
        elif (
            self.tracker is not None and packet[1] in _COPIES and not self.tracker.stepping_on_host
        ):
            self._count_host_copy(packet[1], args)
        return func(*args, **(kwargs or {}))

    def _count_host_copy(self, op: str, args: Any) -> None:
        """`copy_(dst, src)` / `_to_copy(src)` that write or read a host storage.

        A copy between two host storages (a cast on the host) is neither.
        """
        assert self.tracker is not None
        if op == "copy_" and self.tracker.is_host(args[0]) and self.tracker.is_host(args[1]):
            return
        if op == "copy_" and self.tracker.is_host(args[0]) and not self.tracker.is_host(args[1]):
            kind, t = "to_host", args[0]
        elif self.tracker.is_host(args[1] if op == "copy_" else args[0]):
            kind, t = "from_host", args[1] if op == "copy_" else args[0]
        else:
            return
        self.log.calls[kind] += 1
        self.log.bytes[kind] += t.numel() * t.element_size()
