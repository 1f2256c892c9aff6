"""Work-item tables of the multi-tensor fused steps (`_multi_kernels.py` here and in optim-came).

A multi-tensor kernel steps every matrix of a batch (same options, step and dtypes) in one
launch, as torch's fused Adam does with its tensor lists. Triton cannot take a list of tensors,
so each matrix is described by rows of small int64 tables that the kernels read:

- `addr` (n_mats, K): the device addresses (`data_ptr()`) of the matrix's parameter and state
  tensors, cast to typed pointers in the kernel; `gaddr` (n_mats,): its gradient's address
  (rebuilt only when a gradient moved);
- `geo` (n_mats, GEO): rows, columns and the matrix's ranges in the item tables and buffers;
- `a_items` (nA, 4): statistics work items `(matrix, first row, end row, partial offset)`, a
  chunk of rows each, sized so that the whole batch gives a few programs per SM;
- `b_items` (nB, 2): column work items `(matrix, first column)`;
- `d_items` (nD, 2): element-wise work items `(matrix, first row)` of `sub` rows.

The tables and the fp32 scratch buffers are built once per parameter set and cached (keyed
by the addresses, shapes and dtypes), so a step in the steady state launches no torch op here.
Building them is host work plus one pinned, non-blocking copy per table: no synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

#: Fields of a `geo` row.
GEO_N, GEO_M, GEO_CF, GEO_A0, GEO_NA, GEO_B0, GEO_NB, GEO_PART, GEO_INDEX = range(9)
GEO = 9
#: Row chunks of the statistics items never exceed this many rows (partials: 8/ROWS B/elem).
MAX_ITEM_ROWS = 512
#: Tables kept per optimizer (parameter sets seen recently).
CACHE_SIZE = 16


def to_device(rows: list[list[int]] | list[int], device: torch.device) -> Tensor:
    table = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cpu":
        return table
    return table.pin_memory().to(device, non_blocking=True)  # no host sync


def item_rows(total_rows: int, sub: int, n_programs: int) -> int:
    """Rows per statistics item: a multiple of `sub` giving about `n_programs` items in all."""
    blocks = -(-total_rows // sub)
    per_item = max(1, -(-blocks // max(1, n_programs)))
    return min(per_item * sub, max(sub, MAX_ITEM_ROWS // sub * sub))


def target_programs(device: torch.device) -> int:
    """About 4 statistics programs per SM on CUDA; 8 under the interpreter (small grids)."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


@dataclass(slots=True)
class GradAddresses:
    """The gradients' address table of a batch, rebuilt only when a gradient moved."""

    key: tuple[int, ...] = ()
    table: Tensor | None = None

    def __call__(self, grads: Sequence[Tensor]) -> Tensor:
        key = tuple(g.data_ptr() for g in grads)
        if self.table is None or key != self.key:
            self.table = to_device(list(key), grads[0].device)
            self.key = key
        return self.table


@dataclass(slots=True)
class Tables:
    """The cached tables and scratch buffers of one batch of matrices (see module docstring)."""

    signature: tuple[object, ...]
    n_mats: int
    addr: Tensor
    geo: Tensor
    a_items: Tensor
    b_items: Tensor
    d_items: Tensor
    #: fp32 scratch: `colpart`/`wpart` (row-chunk column partials), `rpart`/`ppart` (per
    #: statistics item), `upart` (per column item), `cf` (column factors), `scal` (n_mats, 4).
    buf: dict[str, Tensor]
    partial_floats: int  # floats of one column-partial buffer (bytes accounting)
    grad_addresses: GradAddresses = field(default_factory=GradAddresses)


def build(
    mats: Sequence[Sequence[Tensor]],
    indices: Sequence[int],
    *,
    sub: int,
    block_c: int,
    n_programs: int,
    signature: tuple[object, ...],
) -> Tables:
    """Tables for 2-D matrices; `mats[i]` = (param, *state tensors) whose addresses go in `addr`.

    `indices[i]` is the matrix's position in the step (it seeds stochastic rounding).
    """
    device = mats[0][0].device
    total_rows = sum(int(t[0].shape[0]) for t in mats)
    rows_per_item = item_rows(total_rows, sub, n_programs)
    addr, geo = [], []
    a_items: list[list[int]] = []
    b_items: list[list[int]] = []
    d_items: list[list[int]] = []
    cf_off = part_off = 0
    for i, tensors in enumerate(mats):
        n, m = (int(s) for s in tensors[0].shape)
        addr.append([t.data_ptr() for t in tensors])
        a0, b0 = len(a_items), len(b_items)
        mat_part = part_off
        for r0 in range(0, n, rows_per_item):
            a_items.append([i, r0, min(n, r0 + rows_per_item), part_off])
            part_off += m
        b_items.extend([i, c0] for c0 in range(0, m, block_c))
        d_items.extend([i, r0] for r0 in range(0, n, sub))
        geo.append([n, m, cf_off, a0, len(a_items) - a0, b0, len(b_items) - b0, mat_part,
                    indices[i]])  # fmt: skip
        cf_off += m

    def f32(*shape: int) -> Tensor:
        return torch.empty(shape, dtype=torch.float32, device=device)

    buf = {
        "colpart": f32(max(1, part_off)),
        "wpart": f32(max(1, part_off)),
        "rpart": f32(len(a_items)),
        "ppart": f32(len(a_items)),
        "upart": f32(len(b_items)),
        "cf": f32(max(1, cf_off)),
        "scal": f32(len(mats), 4),
    }
    return Tables(
        signature=signature,
        n_mats=len(mats),
        addr=to_device(addr, device),
        geo=to_device(geo, device),
        a_items=to_device(a_items, device),
        b_items=to_device(b_items, device),
        d_items=to_device(d_items, device),
        buf=buf,
        partial_floats=part_off,
    )


def cached(
    cache: dict[tuple[object, ...], Tables],
    mats: Sequence[Sequence[Tensor]],
    indices: Sequence[int],
    *,
    sub: int,
    block_c: int,
) -> Tables:
    """`build`'s tables from `cache` when the batch's tensors are unchanged, else built anew."""
    signature = (
        *((tuple(t.data_ptr() for t in ts), tuple(ts[0].shape), ts[0].dtype, i)
          for ts, i in zip(mats, indices, strict=True)),
        (sub, block_c),
    )  # fmt: skip
    tables = cache.get(signature)
    if tables is None:
        device = mats[0][0].device
        tables = build(mats, indices, sub=sub, block_c=block_c,
                       n_programs=target_programs(device), signature=signature)  # fmt: skip
        while len(cache) >= CACHE_SIZE:
            cache.pop(next(iter(cache)))
        cache[signature] = tables
    return tables


def aligned(tensors: Sequence[Tensor]) -> bool:
    """Whether every tensor starts 16-byte aligned and its rows are multiples of 16 elements."""
    return all(t.data_ptr() % 16 == 0 and t.shape[-1] % 16 == 0 for t in tensors)
