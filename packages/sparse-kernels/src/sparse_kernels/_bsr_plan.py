"""Per-layout launch plan of the Hopper kernels, built once and cached on the `BlockLayout`.

What the sm_90 launches need beyond the layout's own index tensors: the block rows (forward)
and block columns (dX) in longest-first order, the dW kernel's tile pairs and their split-K
arrival counts. They depend on
the mask only, not on the tokens, so `sm90_plan` builds them once per layout (on the host,
from one copy of the pointers) and a steady-state call launches with no sort, no index
arithmetic and no device -> host copy. `BlockLayout.cached` rebuilds the plan after an
in-place change of the layout's index tensors (e.g. `load_state_dict` of another mask).
The token-dependent parts of a launch (grid size, dW splits) are host integer arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sparse_kernels.layout import BlockLayout


@dataclass(frozen=True)
class Sm90Plan:
    """Index tensors (int32, on the layout's device) of the Hopper launches of one layout."""

    row_order: Tensor
    """(row_blocks,) block rows, most stored tiles first (stable): the forward's item order."""
    col_order: Tensor
    """(col_blocks,) block columns, most stored tiles first (stable): dX's item order."""
    pair_starts: Tensor
    """(pairs + 1,) `pair_starts(row_ptr)`: dW's work items."""
    pair_counts: Tensor
    """(pairs,) zeros: the split-K dW kernel's per-pair arrival counts, which its last item
    of each pair resets to 0, so they are zeroed once per plan, not per call. One launch at a
    time per layout (launches on one stream are ordered)."""
    weight_descs: dict[tuple[int, int], Any] = field(default_factory=dict, compare=False)
    """The weight's TMA descriptors by box shape, with the memory each was built for
    (`_bsr_hopper._weight_desc`): the forward and dX reuse them while the weight's address,
    dtype, shape and strides stay the same."""

    @property
    def n_pairs(self) -> int:
        """Number of dW tile pairs (no device read: the tensor's length)."""
        return self.pair_starts.numel() - 1


def longest_first(ptr: Tensor) -> Tensor:
    """Segments of a CSR/CSC pointer `ptr` ordered by stored tiles, descending, stable (int32)."""
    lengths = ptr[1:] - ptr[:-1]
    return torch.argsort(lengths, descending=True, stable=True).to(torch.int32)


def pair_starts(row_ptr: Tensor) -> Tensor:
    """Start of each pair of consecutive tiles of one block row, and nnzb at the end (int32).

    Pair g is tiles [starts[g], starts[g + 1]): two tiles, or one (the last of a row with an odd
    count). `row_ptr` (row_blocks + 1) is the layout's CSR row pointer.
    """
    lengths = (row_ptr[1:] - row_ptr[:-1]).long()
    rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=row_ptr.device), lengths)
    p = torch.arange(int(row_ptr[-1]), device=row_ptr.device)
    first = (p - row_ptr[rows].long()) % 2 == 0
    return torch.cat([p[first], row_ptr[-1:].long()]).to(torch.int32)


def build_sm90_plan(layout: BlockLayout) -> Sm90Plan:
    """The plan of `layout`, computed on the host (one copy of each pointer) and moved back.

    Raises:
        RuntimeError: while a CUDA graph is being captured (the copies to the host cannot be
            captured): call the layer once before capturing, then the plan is cached.
    """
    dev = layout.row_ptr.device
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the sm_90 launch plan of this layout is built on the first call, which copies the "
            "index to the host and cannot be captured in a CUDA graph: run the layer once "
            "(forward and backward) before capturing"
        )
    row_ptr, col_ptr = layout.row_ptr.cpu(), layout.col_ptr.cpu()
    starts = pair_starts(row_ptr)
    return Sm90Plan(
        row_order=longest_first(row_ptr).to(dev),
        col_order=longest_first(col_ptr).to(dev),
        pair_starts=starts.to(dev),
        pair_counts=torch.zeros(starts.numel() - 1, dtype=torch.int32, device=dev),
    )


def sm90_plan(layout: BlockLayout) -> Sm90Plan:
    """`build_sm90_plan(layout)`, cached on `layout` (rebuilt after its index tensors change)."""
    return layout.cached("sm90_plan", build_sm90_plan)
