"""Per-parameter row sharding and the flat buckets that carry it over the wire.

A parameter of shape (rows, *rest) is cut along dim 0 into `world` pieces of `chunk =
ceil(rows / world)` whole rows; rank r holds rows [min(r*chunk, rows), min((r+1)*chunk, rows)),
which may be empty. Only the communication buckets are padded (to `chunk` rows per rank), so the
tensor each rank's optimizer sees is a real block of whole rows and padded rows never enter any
statistic.

A bucket lays out several parameters rank-major: a (world, S) buffer where row r holds, for each
parameter, the `chunk * row_numel` elements of rank r's (padded) piece. That is exactly the layout
`all_gather_into_tensor` produces and `reduce_scatter_tensor` consumes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class RowShardInfo:
    """The `leanlm_row_shard` declaration: rows [row_offset, row_offset + local rows) of a tensor.

    Attributes:
        global_shape: shape of the whole (logical) parameter.
        row_offset: first row of this rank's piece.
        group: the process group the rows are spread over (None: the default group).
    """

    global_shape: tuple[int, ...]
    row_offset: int
    group: Any = None


@dataclass(eq=False)
class Entry:
    """Book-keeping for one trainable parameter of the model.

    Attributes:
        name: the parameter's (first) qualified name in the model.
        param: the model's parameter (compute dtype; full in stages 1-2, gathered on demand in 3).
        master: the fp32 tensor the optimizer steps: rows [start, end) if sharded, else a replica.
        sharded: False for replicated parameters (small or 0-dim).
        shape: global shape.
        start, end: this rank's rows.
        chunk: rows per rank in the padded communication layout.
        row_numel: elements per row.
        acc: fp32 full-size gradient accumulated over micro-batches (until reduced).
        ready: whether this parameter's gradient arrived in the current backward.
    """

    name: str
    param: nn.Parameter
    master: nn.Parameter
    sharded: bool
    shape: tuple[int, ...]
    start: int
    end: int
    chunk: int
    row_numel: int
    acc: torch.Tensor | None = None
    ready: bool = False

    @property
    def rows(self) -> int:
        """Global number of rows (dim 0)."""
        return self.shape[0] if self.shape else 1

    @property
    def seg(self) -> int:
        """Elements of one rank's padded piece in a bucket."""
        return self.chunk * self.row_numel

    @property
    def local_numel(self) -> int:
        """Elements of this rank's (unpadded) piece."""
        return (self.end - self.start) * self.row_numel


def row_split(rows: int, world: int, rank: int) -> tuple[int, int, int]:
    """`(chunk, start, end)`: the padded rows per rank and rank `rank`'s row range."""
    chunk = max(1, math.ceil(rows / world))
    start = min(rank * chunk, rows)
    return chunk, start, min(start + chunk, rows)


@dataclass(eq=False)
class Bucket:
    """Parameters that travel together in one collective, at `offsets` within each rank row."""

    entries: list[Entry]
    offsets: list[int] = field(default_factory=list)
    size: int = 0
    pending: int = 0
    launched: bool = False
    ident: int = 0  # what `Comm` calls this bucket's gradient reduction

    def __post_init__(self) -> None:
        offset = 0
        self.offsets = []
        for e in self.entries:
            self.offsets.append(offset)
            offset += e.seg
        self.size = offset
        self.pending = len(self.entries)


def _padded_view(buf2d: torch.Tensor, offset: int, e: Entry) -> torch.Tensor:
    return buf2d[:, offset : offset + e.seg].view(buf2d.shape[0], e.chunk, e.row_numel)


def pack_full(buf2d: torch.Tensor, offset: int, e: Entry, full: torch.Tensor | None) -> None:
    """Write the full tensor `full` (or zeros) into the rank-major bucket `buf2d` (world, S)."""
    view = _padded_view(buf2d, offset, e)
    if full is None:
        view.zero_()
        return
    rows = full.reshape(e.rows, e.row_numel)
    q, rem = divmod(e.rows, e.chunk)
    view[:q].copy_(rows[: q * e.chunk].view(q, e.chunk, e.row_numel))
    if rem:
        view[q, :rem].copy_(rows[q * e.chunk :])


def unpack_full(buf2d: torch.Tensor, offset: int, e: Entry, full: torch.Tensor) -> None:
    """Copy the real rows of a gathered rank-major bucket `buf2d` into the full tensor `full`."""
    view = _padded_view(buf2d, offset, e)
    rows = full.view(e.rows, e.row_numel)
    q, rem = divmod(e.rows, e.chunk)
    rows[: q * e.chunk].view(q, e.chunk, e.row_numel).copy_(view[:q])
    if rem:
        rows[q * e.chunk :].copy_(view[q, :rem])


def local_piece(flat: torch.Tensor, offset: int, e: Entry) -> torch.Tensor:
    """This rank's rows of `e` inside one rank's bucket segment `flat` (S,), in `e`'s shape."""
    return flat[offset : offset + e.local_numel].view((e.end - e.start, *e.shape[1:]))


def make_buckets(entries: list[Entry], bucket_numel: int) -> list[Bucket]:
    """Greedy consecutive buckets of at most `bucket_numel` padded elements (at least one entry)."""
    buckets: list[Bucket] = []
    current: list[Entry] = []
    size = 0
    for e in entries:
        if current and size + e.seg > bucket_numel:
            buckets.append(Bucket(current))
            current, size = [], 0
        current.append(e)
        size += e.seg
    if current:
        buckets.append(Bucket(current))
    return buckets
