"""`BlockLayout`: which tiles of a block-sparse weight are stored, indexed both ways."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor

_T = TypeVar("_T")
INDEX_FIELDS = ("row_ptr", "col_idx", "row_idx", "col_ptr", "t_perm")
"""The index tensors of a `BlockLayout`, by field name."""


@dataclass(frozen=True)
class BlockLayout:
    """Block-CSR index of a (out_features, in_features) weight with square tiles.

    Tiles are numbered `p = 0..nnzb-1` in row-major order (block row, then block column); the
    stored values are `(nnzb, block_size, block_size)` with `values[p] = W[tile p]` (edge tiles
    of a shape that is not a multiple of `block_size` are zero-padded).

    Launch plans derived from the index (`cached`) are kept on the object, so reuse one layout
    object across calls (`BlockSparseLinear.layout` does) to build them once.
    """

    out_features: int
    in_features: int
    block_size: int
    row_ptr: Tensor
    """(row_blocks + 1,) int32: tiles of block row r are `row_ptr[r]:row_ptr[r+1]`."""
    col_idx: Tensor
    """(nnzb,) int32 block column of tile p."""
    row_idx: Tensor
    """(nnzb,) int32 block row of tile p."""
    col_ptr: Tensor
    """(col_blocks + 1,) int32: CSC pointers over block columns (for dX = dY·W)."""
    t_perm: Tensor
    """(nnzb,) int32 tile ids ordered by (block column, block row)."""
    _cache: dict[str, tuple[tuple[int, ...], Any]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    index: tuple[Tensor, ...] = field(init=False, repr=False, compare=False)
    """The index tensors in `INDEX_FIELDS` order."""
    _inference: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = tuple(getattr(self, name) for name in INDEX_FIELDS)
        object.__setattr__(self, "index", index)
        # an inference tensor stays one (and has no version counter): decided once
        object.__setattr__(self, "_inference", any(t.is_inference() for t in index))

    def cached(self, key: str, build: Callable[[BlockLayout], _T]) -> _T:
        """`build(self)`, computed once per `key` and reused while the index is unchanged.

        The index tensors' version counters are part of the entry: an in-place change of any
        of them (`copy_`, `load_state_dict`) rebuilds it on the next call. Index tensors made
        under `torch.inference_mode()` have no version counter: then nothing is cached.
        """
        if self._inference:
            return build(self)
        a, b, c, d, e = self.index  # unrolled: a generator costs ~0.5 us per call here
        version = (a._version, b._version, c._version, d._version, e._version)
        hit = self._cache.get(key)
        if hit is not None and hit[0] == version:
            return hit[1]  # type: ignore[no-any-return]
        value = build(self)
        self._cache[key] = (version, value)
        return value

    @property
    def row_blocks(self) -> int:
        """Number of block rows (ceil(out_features / block_size))."""
        return -(-self.out_features // self.block_size)

    @property
    def col_blocks(self) -> int:
        """Number of block columns (ceil(in_features / block_size))."""
        return -(-self.in_features // self.block_size)

    @property
    def nnzb(self) -> int:
        """Number of stored tiles."""
        return int(self.col_idx.numel())

    @property
    def density(self) -> float:
        """Stored tiles / all tiles."""
        return self.nnzb / (self.row_blocks * self.col_blocks)

    @classmethod
    def from_block_mask(
        cls, block_mask: Tensor, *, out_features: int, in_features: int, block_size: int
    ) -> BlockLayout:
        """Build the layout from a (row_blocks, col_blocks) boolean tile mask.

        The index is computed on the host and placed on `block_mask`'s device.

        Raises:
            TypeError: if `block_mask` is not a bool tensor (a float score tensor would keep
                every nonzero tile).
            ValueError: if `block_mask` has the wrong shape or is on the meta device (no data).
        """
        if not isinstance(block_mask, Tensor) or block_mask.dtype != torch.bool:
            got = (
                f"dtype {block_mask.dtype}"
                if isinstance(block_mask, Tensor)
                else type(block_mask).__name__
            )
            raise TypeError(f"`block_mask` must be a bool tensor (True = stored tile), got {got}")
        if block_mask.device.type == "meta":
            raise ValueError(
                "`block_mask` is on the meta device, which holds no data: build it on a real "
                "device (outside `with torch.device('meta')`); the layer's tensors may be meta"
            )
        rb, cb = -(-out_features // block_size), -(-in_features // block_size)
        if tuple(block_mask.shape) != (rb, cb):
            raise ValueError(
                f"`block_mask` shape {tuple(block_mask.shape)} must be ({rb}, {cb}) for a "
                f"({out_features}, {in_features}) weight with block_size {block_size}"
            )
        mask = block_mask.cpu()
        nz = mask.nonzero()
        row_idx, col_idx = nz[:, 0], nz[:, 1]
        zero = torch.zeros(1, dtype=torch.long, device="cpu")  # host, also under a meta context
        row_ptr = torch.cat([zero, mask.sum(1).cumsum(0)])
        col_ptr = torch.cat([zero, mask.sum(0).cumsum(0)])
        t_perm = torch.argsort(col_idx * rb + row_idx)
        dev = block_mask.device
        i32 = torch.int32
        return cls(
            out_features=out_features,
            in_features=in_features,
            block_size=block_size,
            row_ptr=row_ptr.to(dev, i32),
            col_idx=col_idx.to(dev, i32),
            row_idx=row_idx.to(dev, i32),
            col_ptr=col_ptr.to(dev, i32),
            t_perm=t_perm.to(dev, i32),
        )

    def block_mask(self) -> Tensor:
        """The (row_blocks, col_blocks) boolean tile mask."""
        mask = torch.zeros(self.row_blocks, self.col_blocks, dtype=torch.bool, device="cpu")
        mask[self.row_idx.long().cpu(), self.col_idx.long().cpu()] = True
        return mask.to(self.row_idx.device)

    def to(self, device: torch.device) -> BlockLayout:
        """The same layout with its index tensors on `device`."""
        return BlockLayout(
            out_features=self.out_features,
            in_features=self.in_features,
            block_size=self.block_size,
            row_ptr=self.row_ptr.to(device),
            col_idx=self.col_idx.to(device),
            row_idx=self.row_idx.to(device),
            col_ptr=self.col_ptr.to(device),
            t_perm=self.t_perm.to(device),
        )


def dense_to_blocks(weight: Tensor, layout: BlockLayout) -> Tensor:
    """(nnzb, b, b) tiles of a dense (out, in) weight, zero-padded at the edges."""
    b = layout.block_size
    rb, cb = layout.row_blocks, layout.col_blocks
    pad = (0, cb * b - layout.in_features, 0, rb * b - layout.out_features)
    tiles = torch.nn.functional.pad(weight, pad).view(rb, b, cb, b).permute(0, 2, 1, 3)
    return tiles[layout.row_idx.long(), layout.col_idx.long()].contiguous()


def blocks_to_dense(values: Tensor, layout: BlockLayout) -> Tensor:
    """Dense (out, in) weight from (nnzb, b, b) tiles (zeros elsewhere); differentiable."""
    b = layout.block_size
    rb, cb = layout.row_blocks, layout.col_blocks
    flat = values.new_zeros(rb * cb, b, b)
    index = (layout.row_idx.long() * cb + layout.col_idx.long()).to(values.device)
    flat = flat.index_copy(0, index, values)
    dense = flat.view(rb, cb, b, b).permute(0, 2, 1, 3).reshape(rb * b, cb * b)
    return dense[: layout.out_features, : layout.in_features]
