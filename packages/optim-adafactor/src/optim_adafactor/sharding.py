"""The row-sharding protocol: a parameter that holds a contiguous block of rows of a larger tensor.

Factored optimizers need statistics over the whole *logical* tensor (column statistics, the
row-statistic mean, the update and parameter RMS) while a sharding wrapper (FSDP2-style
`Shard(0)`, ZeRO) gives each rank a block of rows. A parameter declares its shard duck-typed,
without importing this package: an attribute ``param.leanlm_row_shard`` with ``global_shape``,
``row_offset`` and ``group`` (a ProcessGroup, or None for the default), or
``optimizer.set_row_shard(param, ...)``, which takes precedence. `Bucket` batches the partial
sums, so a step issues a constant number of collectives per process group, not one per parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: Name of the tensor attribute that declares a row shard (duck-typed, see the module docstring).
ROW_SHARD_ATTR = "leanlm_row_shard"


@dataclass(frozen=True, kw_only=True, slots=True)
class RowShard:
    """Rows `[row_offset, row_offset + local_rows)` of a logical tensor of `global_shape`.

    Attributes:
        global_shape: Shape of the whole logical tensor; all dims but 0 equal the local shape's.
        row_offset: Index along dim 0 of the logical tensor where this rank's block starts.
        group: Process group the logical tensor is spread over (None: the default group).
    """

    global_shape: tuple[int, ...]
    row_offset: int
    group: Any = None

    @property
    def global_numel(self) -> int:
        """Number of elements of the logical tensor."""
        return math.prod(self.global_shape)


def make_row_shard(
    param: torch.Tensor, *, global_shape: Sequence[int], row_offset: int, group: Any = None
) -> RowShard:
    """Validate a row-shard declaration for `param` and return it as a `RowShard`."""
    if isinstance(global_shape, torch.Size | tuple | list):
        shape = tuple(int(s) for s in global_shape)
    else:
        raise TypeError(f"`global_shape` must be a sequence of ints, got {global_shape!r}")
    if param.dim() == 0:
        raise ValueError("a 0-dim parameter has no rows and cannot be row-sharded")
    if len(shape) != param.dim() or tuple(shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(
            f"`global_shape` {shape} must match the local shape {tuple(param.shape)} in every "
            "dim but 0"
        )
    if isinstance(row_offset, bool) or not isinstance(row_offset, int):
        raise TypeError(f"`row_offset` must be an int, got {row_offset!r}")
    if row_offset < 0 or row_offset + param.shape[0] > shape[0]:
        raise ValueError(
            f"`row_offset` ({row_offset}) + local rows ({param.shape[0]}) must lie within the "
            f"global rows ({shape[0]})"
        )
    return RowShard(global_shape=shape, row_offset=row_offset, group=group)


def row_shard_of(param: torch.Tensor, registry: dict[torch.Tensor, RowShard]) -> RowShard | None:
    """The row shard declared for `param` (registry first, then the tensor attribute), if any."""
    shard = registry.get(param)
    if shard is not None:
        return shard
    declared = getattr(param, ROW_SHARD_ATTR, None)
    if declared is None:
        return None
    if isinstance(declared, RowShard):
        return declared
    return make_row_shard(
        param,
        global_shape=declared.global_shape,
        row_offset=declared.row_offset,
        group=getattr(declared, "group", None),
    )


class Bucket:
    """Tensors to be summed over process groups with ONE all-reduce per group.

    `add(group, tensor)` queues a tensor and returns a handle; `all_reduce()` concatenates the
    queued tensors of each group into one flat fp32 buffer, all-reduces it (SUM) and makes the
    reduced values available through `get(handle)`.
    """

    def __init__(self) -> None:
        self._groups: dict[int, Any] = {}
        self._items: dict[int, list[torch.Tensor]] = {}
        self._results: dict[tuple[int, int], torch.Tensor] = {}
        self.collectives = 0

    def add(self, group: Any, tensor: torch.Tensor) -> tuple[int, int]:
        """Queue `tensor` for summation over `group`; the handle is used with `get`."""
        key = id(group)
        self._groups[key] = group
        items = self._items.setdefault(key, [])
        items.append(tensor)
        return key, len(items) - 1

    def all_reduce(self) -> None:
        """Issue one SUM all-reduce per process group over everything queued."""
        for key, items in self._items.items():
            flat = torch.cat([t.reshape(-1).float() for t in items])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._groups[key])
            self.collectives += 1
            for index, part in enumerate(torch.split(flat, [t.numel() for t in items])):
                self._results[(key, index)] = part.view(items[index].shape)
        self._items.clear()

    def get(self, handle: tuple[int, int]) -> torch.Tensor:
        """The reduced value of a queued tensor (after `all_reduce`)."""
        return self._results[handle]
