"""Work split of the multi-tensor fused steps, and the launch plan read from it.

Triton cannot take a list of tensors, so each matrix of a batch is a row of small int64 tables
(device addresses, geometry, work items; see `build`) that the kernels read, as torch's fused
AdamW does with its tensor lists. Row items of whole rows and at most `ITEM_ELEMENTS` elements
(`rows_per_item`) give every program of a pass about the same work whatever a matrix's width;
column partials are summed in a fixed order (deterministic, no atomics), and a batch is launched
in groups so the scratch stays bounded (`MAX_PARTIAL_FLOATS`). Tables are built once per parameter
set and cached, without host sync; `plan_launches` records the launches of a real `step()` on
meta tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

#: Fields of a `geo` row (item offsets are relative to the matrix's group).
GEO_N, GEO_M, GEO_CF, GEO_A0, GEO_NA, GEO_B0, GEO_NB, GEO_PART, GEO_INDEX = range(9)
GEO = 9
#: Elements of a row item (small under the interpreter, so tests cover multi-block items).
ITEM_ELEMENTS = 1024 if _INTERPRET else 1 << 16
#: Column partials one column item reads (per buffer).
COL_PARTIALS = 256 if _INTERPRET else 1 << 14
#: Floats of one column-partial buffer per group (tests patch it smaller to cover groups).
MAX_PARTIAL_FLOATS = 1 << 12 if _INTERPRET else 1 << 24
#: Tables kept per optimizer (parameter sets seen recently).
CACHE_SIZE = 16


def to_device(rows: list[list[int]] | list[int], device: torch.device) -> Tensor:
    """An int64 table on `device`; to CUDA through pinned memory, without host sync."""
    table = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cpu":
        return table
    if device.type != "cuda":  # meta: a launch plan
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)  # no host sync


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def rows_per_item(n: int, m: int, sub: int) -> int:
    """Rows R of a row item of an (n, m) matrix: the most whole row tiles with R·m <= ITEM_ELEMENTS.

    R is a multiple of `sub` (the kernels' row tile), at least one tile: rows wider than
    ITEM_ELEMENTS / sub make items of one tile (more elements, but no masked tile rows and no
    more column partials per element than one per `sub` rows). More rows only where the
    matrix's partials alone would exceed `MAX_PARTIAL_FLOATS`.
    """
    fit = ITEM_ELEMENTS // m
    rows = max(sub, fit - fit % sub)
    items_allowed = max(1, MAX_PARTIAL_FLOATS // m)
    if -(-n // rows) > items_allowed:
        rows = sub * ceil_div(ceil_div(n, items_allowed), sub)
    return rows


def cols_per_item(n_items: int, m: int, block_c: int) -> int:
    """Columns of a column item: multiples of `block_c` reading about COL_PARTIALS partials."""
    tiles = max(1, COL_PARTIALS // max(1, n_items * block_c))
    return min(tiles * block_c, -(-m // block_c) * block_c)


@dataclass(frozen=True, slots=True)
class Work:
    """Elements per program of one launch: programs, max, mean, total."""

    programs: int
    max_elements: int
    mean_elements: float
    total: int

    @classmethod
    def of(cls, sizes: Sequence[int]) -> Work:
        total = sum(sizes)
        return cls(len(sizes), max(sizes, default=0), total / max(1, len(sizes)), total)


@dataclass(slots=True)
class GradAddresses:
    """The gradients' address table of a batch, rebuilt only when a gradient moved."""

    key: tuple[int, ...] = ()
    table: Tensor | None = None
    slices: list[Tensor] = field(default_factory=list)  # from the starts of `__call__`

    def __call__(self, grads: Sequence[Tensor], starts: Sequence[int] = (0,)) -> list[Tensor]:
        """The table's slices from each of `starts` (views made once per table)."""
        key = tuple(g.data_ptr() for g in grads)
        if self.table is None or key != self.key or len(self.slices) != len(starts):
            self.table = to_device(list(key), grads[0].device)
            self.key = key
            self.slices = [self.table[s:] if s else self.table for s in starts]
        return self.slices


@dataclass(slots=True)
class Group:
    """Consecutive matrices launched together: their slices of the tables and their work."""

    mat0: int  # first matrix: offset into `addr`, `geo`, `gaddr` and `scal`
    n_mats: int
    addr: Tensor
    geo: Tensor
    scal: Tensor  # the group's rows of the (n_mats, 4) step scalars
    rows: Tensor
    cols: Tensor
    row_work: Work  # elements per row item
    col_work: Work  # partials per column item (one buffer)
    partial_floats: int  # Σ items·m: floats of one column-partial buffer
    n_rows: int  # Σ n (row statistics read and written)
    n_cols: int  # Σ m (column statistics read and written)
    mat_work: Work  # partial sums per matrix (the scalar kernel)


@dataclass(slots=True)
class Tables:
    """The cached tables of one batch and the scratch buffers its groups share."""

    signature: tuple[object, ...]
    n_mats: int
    groups: list[Group]
    #: fp32 scratch: `colpart`/`wpart` (column partials of each row item), `rowpart` (row
    #: partials of each row block and column tile), `rpart`/`ppart` (per row item), `upart`
    #: (per column item), `cf` (column factors), `scal` (n_mats, 4; not shared by groups).
    buf: dict[str, Tensor]
    grad_addresses: GradAddresses = field(default_factory=GradAddresses)

    def gaddr(self, grads: Sequence[Tensor]) -> list[Tensor]:
        """Each group's slice of the gradients' address table."""
        return self.grad_addresses(grads, [g.mat0 for g in self.groups])

    def scratch_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buf.values())


def partition(shapes: Sequence[tuple[int, int]], sub: int) -> list[range]:
    """Consecutive matrices whose column partials fit one buffer of MAX_PARTIAL_FLOATS.

    The groups are about equal (each launch of a group then fills the GPU alike).
    """
    floats = [ceil_div(n, rows_per_item(n, m, sub)) * m for n, m in shapes]
    target = sum(floats) / ceil_div(sum(floats), MAX_PARTIAL_FLOATS)
    groups: list[range] = []
    first, acc = 0, 0
    for i, f in enumerate(floats):
        if i > first and (acc >= target or acc + f > MAX_PARTIAL_FLOATS):
            groups.append(range(first, i))
            first, acc = i, 0
        acc += f
    groups.append(range(first, len(shapes)))
    return groups


def build(
    mats: Sequence[Sequence[Tensor]],
    indices: Sequence[int],
    *,
    sub: int,
    block_m: int,
    block_c: int,
    signature: tuple[object, ...] = (),
) -> Tables:
    """Tables for 2-D matrices; `mats[i]` = (param, *state tensors) whose addresses go in `addr`.

    `indices[i]` is the matrix's position in the step (it seeds stochastic rounding); `block_m`
    is the column tile of the row-partial buffer (one float per row and tile). The tables:

    - `addr` (n_mats, K): device addresses (`data_ptr()`) of the parameter and state tensors;
      `gaddr` (n_mats,): the gradient's (`Tables.gaddr`, rebuilt only when a gradient moved);
    - `geo` (n_mats, GEO): rows, columns and the matrix's ranges in the item tables and buffers;
    - `rows` (nR, 5): row items `(matrix, first row, end row, partial offset, row-partial
      offset)`, R whole rows with R·m <= `ITEM_ELEMENTS` (`rows_per_item`); each writes its
      column partials once;
    - `cols` (nC, 3): column items `(matrix, first column, end column)`, each summing about
      `COL_PARTIALS` partials of its columns over the matrix's row items.
    """
    device = mats[0][0].device
    shapes = [(int(ts[0].shape[0]), int(ts[0].shape[1])) for ts in mats]
    geo: list[list[int]] = []
    rows: list[list[int]] = []
    cols: list[list[int]] = []
    spans = []  # per group: (matrices, row items, column items, work, sizes)
    for mats_range in partition(shapes, sub):
        r_start, c_start = len(rows), len(cols)
        row_sizes: list[int] = []
        col_sizes: list[int] = []
        part = rowpart = cf = 0
        for local, i in enumerate(mats_range):
            n, m = shapes[i]
            r, tiles = rows_per_item(n, m, sub), -(-m // block_m)
            a0, b0, part0 = len(rows) - r_start, len(cols) - c_start, part
            for r0 in range(0, n, r):
                r1 = min(n, r0 + r)
                rows.append([local, r0, r1, part, rowpart])
                row_sizes.append((r1 - r0) * m)
                part += m
                rowpart += (r1 - r0) * tiles
            n_items = len(rows) - r_start - a0
            width = cols_per_item(n_items, m, block_c)
            for c0 in range(0, m, width):
                cols.append([local, c0, min(m, c0 + width)])
                col_sizes.append(n_items * (min(m, c0 + width) - c0))
            geo.append([n, m, cf, a0, n_items, b0, len(cols) - c_start - b0, part0,
                        indices[i]])  # fmt: skip
            cf += m
        spans.append((mats_range, range(r_start, len(rows)), range(c_start, len(cols)),
                      row_sizes, col_sizes, part, rowpart, cf))  # fmt: skip

    scal = torch.empty((len(mats), 4), dtype=torch.float32, device=device)
    t_addr = to_device([[t.data_ptr() for t in ts] for ts in mats], device)
    t_geo, t_rows, t_cols = to_device(geo, device), to_device(rows, device), to_device(cols, device)
    groups = [
        Group(
            mat0=ms.start, n_mats=len(ms), addr=t_addr[ms.start :], geo=t_geo[ms.start :],
            scal=scal[ms.start :],
            rows=t_rows[rs.start : rs.stop], cols=t_cols[cs.start : cs.stop],
            row_work=Work.of(r_sizes), col_work=Work.of(c_sizes), partial_floats=part,
            n_rows=sum(shapes[i][0] for i in ms), n_cols=cf,
            mat_work=Work.of([2 * geo[i][GEO_NA] + geo[i][GEO_NB] for i in ms]),
        )
        for ms, rs, cs, r_sizes, c_sizes, part, _, cf in spans
    ]  # fmt: skip

    def f32(n: int) -> Tensor:
        return torch.empty(max(1, n), dtype=torch.float32, device=device)

    biggest = max(s[5] for s in spans)
    buf = {
        "colpart": f32(biggest),
        "wpart": f32(biggest),
        "rowpart": f32(max(s[6] for s in spans)),
        "rpart": f32(max(len(g.rows) for g in groups)),
        "ppart": f32(max(len(g.rows) for g in groups)),
        "upart": f32(max(len(g.cols) for g in groups)),
        "cf": f32(max(g.n_cols for g in groups)),
        "scal": scal,
    }
    return Tables(signature=signature, n_mats=len(mats), groups=groups, buf=buf)


def cached(
    cache: dict[tuple[object, ...], Any],
    mats: Sequence[Sequence[Tensor]],
    indices: Sequence[int],
    *,
    sub: int,
    block_m: int,
    block_c: int,
) -> Tables:
    """`build`'s tables from `cache` when the batch's tensors are unchanged, else built anew."""
    signature = (
        *((tuple(t.data_ptr() for t in ts), tuple(ts[0].shape), ts[0].dtype, i)
          for ts, i in zip(mats, indices, strict=True)),
        (sub, block_m, block_c, ITEM_ELEMENTS, MAX_PARTIAL_FLOATS),
    )  # fmt: skip
    tables = cache.get(signature)
    if tables is None or _PLAN is not None:  # meta tensors all have address 0
        tables = build(mats, indices, sub=sub, block_m=block_m, block_c=block_c,
                       signature=signature)  # fmt: skip
        remember(cache, signature, tables)
    return tables


def remember(cache: dict[tuple[object, ...], Any], key: tuple[object, ...], value: Any) -> None:
    """Put `value` in `cache`, dropping the oldest entries beyond CACHE_SIZE."""
    while len(cache) >= CACHE_SIZE:
        cache.pop(next(iter(cache)))
    cache[key] = value


def aligned(tensors: Sequence[Tensor]) -> bool:
    """Whether every tensor starts 16-byte aligned and its rows are multiples of 16 elements."""
    return all(t.data_ptr() % 16 == 0 and t.shape[-1] % 16 == 0 for t in tensors)


def size(dtype: torch.dtype) -> int:
    """Bytes of one element of `dtype`."""
    return dtype.itemsize


# ------------------------------------------------------------------------------ launch plan
@dataclass(frozen=True, slots=True)
class Launch:
    """One kernel launch of a step: its grid and the DRAM bytes it moves (from the kernel)."""

    kernel: str
    programs: int
    max_elements: int
    mean_elements: float
    bytes: int


_PLAN: list[Launch] | None = None  # set by `recording`


def planning() -> bool:
    """Whether launches are being recorded (`plan_launches`) instead of made."""
    return _PLAN is not None


def planned(kernel: Any, work: Work, nbytes: float) -> bool:
    """Record the launch of `kernel` while planning (and return True: do not launch)."""
    if _PLAN is None:
        return False
    name = getattr(kernel, "__name__", str(kernel))
    _PLAN.append(Launch(name, work.programs, work.max_elements, work.mean_elements, int(nbytes)))
    return True


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """Record the launches the multi-tensor steps make (on meta tensors) instead of making them."""
    global _PLAN  # noqa: PLW0603 (one switch for every launch site)
    previous, _PLAN = _PLAN, []
    try:
        yield _PLAN
    finally:
        _PLAN = previous


def plan_launches(
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    shapes: Sequence[Sequence[int]],
    dtype: torch.dtype,
) -> list[Launch]:
    """The launches one steady-state `step()` makes for parameters of `shapes` and `dtype`.

    The optimizer's own `step()` runs on meta tensors (no data, any size), with the kernels'
    GPU tiles when the process is not interpreting; each launch is recorded, not made. The
    first step (which creates the state) is not counted.
    """
    params = [torch.nn.Parameter(torch.empty(s, dtype=dtype, device="meta")) for s in shapes]
    opt = make_optimizer(params)
    with recording() as launches:
        for _ in range(2):
            launches.clear()
            for p in params:
                p.grad = torch.empty_like(p)
            opt.step()
    return list(launches)
