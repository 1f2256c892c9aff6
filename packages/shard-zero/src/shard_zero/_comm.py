"""Collectives used by shard-zero, behind a version shim and a byte/call counter.

torch 2.13 deprecates `all_gather_into_tensor` / `reduce_scatter_tensor` in favour of
`all_gather_single` / `reduce_scatter_single` (same arguments); older torch has only the former.
Every collective goes through `Comm`, which counts calls and bytes per kind so that tests and
benchmarks can check communication volume in code (gloo emulates reduce-scatter with all-reduce,
so CPU timings say nothing about volume).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Comm:
    """The process group plus per-kind counters of calls and bytes.

    Bytes are counted as the size of the full (gathered / pre-scatter / reduced) buffer, i.e. the
    logical volume one rank contributes to and receives from, as in the ZeRO paper's 2Ψ / 3Ψ.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.last_step: dict[str, dict[str, int]] = {}

    def _count(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool) -> Any:
        """`out` (world * n,) <- concatenation of every rank's `inp` (n,)."""
        self._count("all_gather", _nbytes(out))
        return _all_gather(out, inp, group=self.group, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool) -> Any:
        """`out` (n,) <- sum over ranks of this rank's chunk of `inp` (world * n,)."""
        self._count("reduce_scatter", _nbytes(inp))
        return _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_reduce(self, t: torch.Tensor, *, op: Any = None, async_op: bool = False) -> Any:
        """In-place all-reduce of `t` (SUM unless `op` is given)."""
        self._count("all_reduce", _nbytes(t))
        return dist.all_reduce(
            t, op=dist.ReduceOp.SUM if op is None else op, group=self.group, async_op=async_op
        )

    def end_step(self) -> None:
        """Snapshot the counters as `last_step` and reset them (called after each step)."""
        self.last_step = {
            kind: {"calls": self.calls[kind], "bytes": self.bytes[kind]} for kind in self.calls
        }
        self.calls.clear()
        self.bytes.clear()
