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
        acc: replicated parameters at stages 2-3: the fp32 gradient accumulated over
            backwards until the end-of-backward all-reduce.
        low_acc: sharded parameters with `accum_dtype=torch.bfloat16`: this rank's reduced
            gradient rows accumulated in bf16, until cast into `master.grad`.
        host_acc: sharded parameters with `offload_accum`: this rank's reduced gradient rows
            accumulated in host memory (`accum_dtype`) over the backwards run under
            `no_sync()`; allocated once, holding data only while `host_has` is set.
        host_has: whether `host_acc` holds gradients not yet added into `master.grad`.
        dev_grad: `offload_optimizer`: the fp32 gradient accumulator on the device (the role
            `master.grad` plays without offload), until it is copied into `host_grad`.
        host_grad: `offload_optimizer`: the host buffer the gradient is copied into (pinned on
            CUDA), allocated once; it is `master.grad` while it holds a gradient.
        host_rows: `offload_optimizer` with a compute dtype other than fp32: this rank's rows
            of the master cast to the compute dtype on the host (pinned on CUDA), the source of
            the parameter all-gathers.
        ready: whether this parameter's gradient was packed into its bucket in this backward.
        held: stages 2-3, a parameter travelling in pieces: its gradient (compute dtype) from
            its arrival until its last piece is packed.
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
    low_acc: torch.Tensor | None = None
    host_acc: torch.Tensor | None = None
    host_has: bool = False
    dev_grad: torch.Tensor | None = None
    host_grad: torch.Tensor | None = None
    host_rows: torch.Tensor | None = None
    ready: bool = False
    held: torch.Tensor | None = None

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
    """Parameters that travel together in one collective, at `offsets` within each rank row.

    A *piece* (`rows` set) carries rows [a, b) of every rank's chunk of its single entry: a
    parameter larger than a bucket travels in several pieces, so no communication buffer is
    larger than `bucket_numel` elements (beyond one row per rank).
    """

    entries: list[Entry]
    rows: tuple[int, int] | None = None
    offsets: list[int] = field(default_factory=list)
    size: int = 0
    pending: int = 0  # gradients still to arrive in this backward
    ident: int = 0  # what `Comm` calls this bucket's gradient reduction
    buf: torch.Tensor | None = None  # (world, size) reduce-scatter input being packed

    def __post_init__(self) -> None:
        if self.rows is not None:
            assert len(self.entries) == 1
            assert 0 <= self.rows[0] < self.rows[1]
            a, b = self.rows
            self.offsets = [0]
            self.size = (b - a) * self.entries[0].row_numel
        else:
            offset = 0
            self.offsets = []
            for e in self.entries:
                self.offsets.append(offset)
                offset += e.seg
            self.size = offset
        self.pending = len(self.entries)

    def span(self, e: Entry) -> tuple[int, int]:
        """The rows of each rank's chunk of `e` this bucket carries."""
        return self.rows if self.rows is not None else (0, e.chunk)


def _view(buf2d: torch.Tensor, offset: int, e: Entry, span: tuple[int, int]) -> torch.Tensor:
    n = span[1] - span[0]
    return buf2d[:, offset : offset + n * e.row_numel].view(buf2d.shape[0], n, e.row_numel)


def _last_rank_rows(e: Entry, span: tuple[int, int]) -> tuple[int, int]:
    """`(q, n)`: ranks < q hold whole chunks; rank q holds `n` rows of `span` (maybe 0)."""
    q, rem = divmod(e.rows, e.chunk)
    return q, max(0, min(span[1], rem) - span[0])


def pack_full(
    buf2d: torch.Tensor,
    offset: int,
    e: Entry,
    full: torch.Tensor | None,
    span: tuple[int, int] | None = None,
) -> None:
    """Write rows `span` of every rank's chunk of `full` (or zeros) into `buf2d` (world, S)."""
    a, b = span or (0, e.chunk)
    view = _view(buf2d, offset, e, (a, b))
    if full is None:
        view.zero_()
        return
    rows = full.reshape(e.rows, e.row_numel)
    q, n = _last_rank_rows(e, (a, b))
    if q:
        view[:q].copy_(rows[: q * e.chunk].view(q, e.chunk, e.row_numel)[:, a:b])
    if n:
        view[q, :n].copy_(rows[q * e.chunk + a : q * e.chunk + a + n])


def unpack_pairs(
    buf2d: torch.Tensor,
    offset: int,
    e: Entry,
    full: torch.Tensor,
    span: tuple[int, int] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`(destination, source)` views that copy the real rows `span` of `buf2d` into `full`.

    `buf2d` is a gathered rank-major bucket (world, S): the whole chunks of ranks < q are one
    pair, rank q's remaining rows (if any) another.
    """
    a, b = span or (0, e.chunk)
    view = _view(buf2d, offset, e, (a, b))
    rows = full.view(e.rows, e.row_numel)
    q, n = _last_rank_rows(e, (a, b))
    pairs = []
    if q:
        pairs.append((rows[: q * e.chunk].view(q, e.chunk, e.row_numel)[:, a:b], view[:q]))
    if n:
        pairs.append((rows[q * e.chunk + a : q * e.chunk + a + n], view[q, :n]))
    return pairs


def unpack_full(
    buf2d: torch.Tensor,
    offset: int,
    e: Entry,
    full: torch.Tensor,
    span: tuple[int, int] | None = None,
) -> None:
    """Copy the real rows `span` of a gathered rank-major bucket `buf2d` into `full`."""
    copy_pairs(unpack_pairs(buf2d, offset, e, full, span))


def copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]], *, from_host: bool = False) -> None:
    """`dst.copy_(src)` (casting) for every pair, as one `torch._foreach_copy_` (one launch).

    `from_host` (`offload_optimizer`: the sources are host rows): one asynchronous host-to-
    device `copy_` each instead.
    """
    if from_host:
        for d, s in pairs:
            d.copy_(s, non_blocking=True)
    elif pairs:
        dst, src = zip(*pairs, strict=True)
        torch._foreach_copy_(list(dst), list(src))


def local_rows(e: Entry, span: tuple[int, int]) -> tuple[int, int]:
    """`(first, count)`: this rank's rows of `e` (relative to its shard) inside `span`."""
    a, b = span
    return a, max(0, min(b, e.end - e.start) - a)


def local_piece(
    flat: torch.Tensor, offset: int, e: Entry, span: tuple[int, int] | None = None
) -> torch.Tensor:
    """This rank's rows of `e` inside one rank's bucket segment `flat` (S,), in `e`'s shape."""
    _, n = local_rows(e, span or (0, e.chunk))
    return flat[offset : offset + n * e.row_numel].view((n, *e.shape[1:]))


def make_buckets(entries: list[Entry], bucket_numel: int, world: int) -> list[Bucket]:
    """Greedy consecutive buckets of at most `bucket_numel` elements over all `world` ranks.

    An entry larger than that on its own is cut into pieces of whole rows per rank (at least
    one row per rank each). A bucket never mixes parameter dtypes: its parameters are
    all-gathered in one buffer of their dtype, so an entry whose dtype differs from the
    current bucket's starts a new one.
    """
    buckets: list[Bucket] = []
    current: list[Entry] = []
    size = 0
    for e in entries:
        if current and current[0].param.dtype != e.param.dtype:
            buckets.append(Bucket(current))
            current, size = [], 0
        if world * e.seg > bucket_numel and e.chunk > 1:
            if current:
                buckets.append(Bucket(current))
                current, size = [], 0
            per = max(1, bucket_numel // (world * e.row_numel))
            for a in range(0, e.chunk, per):
                buckets.append(Bucket([e], rows=(a, min(a + per, e.chunk))))
            continue
        if current and world * (size + e.seg) > bucket_numel:
            buckets.append(Bucket(current))
            current, size = [], 0
        current.append(e)
        size += e.seg
    if current:
        buckets.append(Bucket(current))
    return buckets
