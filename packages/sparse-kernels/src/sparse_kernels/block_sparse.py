"""`BlockSparseLinear`: a Linear whose weight stores only its active b x b tiles.

```python
layer = BlockSparseLinear.from_dense(linear, block_size=64, sparsity=0.9, backend="auto")
y = layer(x)  # same shapes as linear(x), bias kept
```

The trainable parameter is `values` (nnzb, b, b): pruned tiles do not exist, so they cannot be
revived by any optimizer, and forward, dX and dW all cost `density x dense` FLOPs. Backends:

* `"triton"`: the kernels in `_bsr_kernels` (CUDA; on CPU only under TRITON_INTERPRET=1); on an
  sm_90 GPU forward and dX run the TMA/wgmma persistent kernel of `_bsr_hopper` instead, dW
  that of `_bsr_hopper_dw` (block sizes 64/128, not IEEE fp32, where `_bsr_hopper.prefer_sm90`
  says they are faster: at least 256 tokens and 45 G multiply-adds, tokens x stored weight
  elements, the crossover measured on an H100; `SPARSE_KERNELS_SM90` = "1"/"0" forces them
  on/off), with a launch plan built once per layout (`_bsr_plan`);
* `"torch"`: PyTorch ops in `_bsr_torch` (CPU fp32: torch's BSR x dense; other dtypes: one GEMM
  per tile);
* `"auto"`: Triton on CUDA when installed and block_size is 16, 32, 64 or 128, else torch.

fp32 on the Triton path follows `torch.get_float32_matmul_precision()` as `nn.Linear` does:
"highest" runs IEEE fp32 dots, "high"/"medium" TF32 (`_bsr_launch.dot_precision`).

Under autocast (`torch.autocast` enabled for x's device type) the layer computes as `nn.Linear`
does: x, values and bias are cast to the autocast dtype before the kernels (which then run with
autocast off), the output has that dtype, and the gradients, computed in that dtype, reach
fp32 `values` and `bias` through the casts as fp32 tensors. Without autocast nothing is cast.

Higher-order gradients: a backward run with `create_graph=True` computes dX, dW's tiles and db
with differentiable PyTorch ops through the dense weight on every backend (dense cost), so a
gradient penalty differentiates as it does through `F.linear`.

The autograd Function and the per-call kernel choice live in `_bsr_autograd`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, Self

import torch
from torch import Tensor, nn

from sparse_kernels._bsr_autograd import _autocast_off, _autocasting, _BlockSparseMM, _forward
from sparse_kernels._triton import HAS_TRITON, available
from sparse_kernels.config import BLOCK_SIZES, check_int
from sparse_kernels.layout import INDEX_FIELDS, BlockLayout, blocks_to_dense, dense_to_blocks
from sparse_kernels.masks import block_scores, warn_if_empty

Backend = Literal["auto", "torch", "triton"]


def resolve_backend(backend: str, device: torch.device, block_size: int) -> str:
    """`"torch"` or `"triton"` for `backend` on `device`.

    Raises:
        ValueError: for an unknown backend, or `"triton"` where the kernels cannot run.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"`backend` ({backend!r}) must be 'auto', 'torch' or 'triton'")
    kernel_ok = block_size in BLOCK_SIZES
    if backend == "auto":
        return "triton" if device.type == "cuda" and HAS_TRITON and kernel_ok else "torch"
    if backend == "triton":
        if not available(device):
            raise ValueError(
                f"backend 'triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 on "
                f"CPU); got {device}"
            )
        if not kernel_ok:
            raise ValueError(
                f"backend 'triton' needs `block_size` in {BLOCK_SIZES}, got {block_size}"
            )
    return backend


_resolved = functools.cache(resolve_backend)  # the same answer per (backend, device, block)


def block_sparse_linear(
    x: Tensor,
    values: Tensor,
    layout: BlockLayout,
    bias: Tensor | None = None,
    *,
    backend: Backend = "auto",
) -> Tensor:
    """`x @ Wᵀ + bias` for the block-sparse W given by `values` and `layout`; differentiable.

    Args:
        x: (..., in_features).
        values: (nnzb, b, b) stored tiles.
        layout: the tile index.
        bias: (out_features,) or None.
        backend: `"auto"`, `"torch"` or `"triton"`.

    Returns:
        (..., out_features) in x's dtype; under autocast for x's device type, in the autocast
        dtype (x, values and bias are cast to it first, as `nn.Linear`'s are).

    Raises:
        ValueError: if x's last dimension is not `layout.in_features`, `values` is not of shape
            (layout.nnzb, b, b) or not on x's device, or `bias` is not of shape
            (out_features,) or not on `values`' device (every backend).
        TypeError: if x's dtype (after an autocast cast) is not `values`' dtype, as on the
            Triton backend (every backend; `nn.Linear` raises too).
    """
    if x.dim() == 0 or x.shape[-1] != layout.in_features:
        got = "a 0-d tensor" if x.dim() == 0 else f"{x.shape[-1]} features"
        raise ValueError(f"`x` has {got}, expected {layout.in_features} (`in_features`)")
    chosen = _resolved(backend, x.device, layout.block_size)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    device_type = x.device.type
    if _autocasting(device_type):
        # nn.Linear's autocast rule: every operand in the autocast dtype; the casts are autograd
        # ops, so dvalues / dbias come back to the fp32 parameters through them
        dtype = torch.get_autocast_dtype(device_type)
        x2, values = x2.to(dtype), values.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    _check_operands(x2, values, bias, layout)
    with _autocast_off(device_type):  # the kernels see uniform dtypes
        y = _call(x2, values, bias, layout, chosen)
    return y.reshape(*lead, layout.out_features)


def _check_operands(x2: Tensor, values: Tensor, bias: Tensor | None, layout: BlockLayout) -> None:
    """The checks every backend shares (the Triton launcher's `values` rules, the bias's).

    The torch backend builds its BSR tensor without checking it, so `values` that do not match
    `layout` would be read out of bounds there.
    """
    b = layout.block_size
    if tuple(values.shape) != (layout.nnzb, b, b):
        raise ValueError(f"`values` shape {tuple(values.shape)} must be ({layout.nnzb}, {b}, {b})")
    if x2.dtype != values.dtype:
        raise TypeError(f"`x` dtype {x2.dtype} must equal `values` dtype {values.dtype}")
    if x2.device != values.device:
        raise ValueError(f"`x` is on {x2.device} but `values` on {values.device}")
    if bias is None:
        return
    if tuple(bias.shape) != (layout.out_features,):
        raise ValueError(
            f"`bias` shape {tuple(bias.shape)} must be ({layout.out_features},) (`out_features`)"
        )
    if bias.device != values.device:
        raise ValueError(f"`bias` is on {bias.device} but `values` on {values.device}")


def _call(
    x2: Tensor, values: Tensor, bias: Tensor | None, layout: BlockLayout, chosen: str
) -> Tensor:
    """(tokens, out_features): through `_BlockSparseMM` when a gradient is needed."""
    if torch.is_grad_enabled() and (
        x2.requires_grad or values.requires_grad or (bias is not None and bias.requires_grad)
    ):
        y: Tensor = _BlockSparseMM.apply(x2, values, bias, layout, chosen)  # type: ignore[no-untyped-call]
        return y
    # nothing to differentiate (no_grad, inference): the same kernels, no autograd node
    return _forward(x2, values, bias, layout, chosen)[0]


class BlockSparseLinear(nn.Module):
    """A Linear with a block-sparse weight (only active tiles stored and trained).

    Args:
        in_features: input features.
        out_features: output features.
        block_mask: (ceil(out/b), ceil(in/b)) boolean tile mask (True = stored).
        block_size: tile edge b.
        bias: whether to add a bias.
        backend: `"auto"`, `"torch"` or `"triton"`.
        device: device of the parameters and index buffers (None: torch's default, which
            `with torch.device(...)` sets).
        dtype: dtype of the parameters.

    On the meta device (FSDP2 / torchtitan init) the layer keeps a host copy of its tile index:
    `to_empty()` off the meta device restores the index from it, so `to_empty()` then
    `reset_parameters()` (or `load_state_dict`) gives a working layer, the same as building
    on that device with the same RNG state. After `fully_shard` (tiles a DTensor),
    `reset_parameters()` gathers the tiles to zero the edge padding: call it on every rank.

    Raises:
        TypeError: if `in_features`, `out_features` or `block_size` is not an int, or
            `block_mask` is not a bool tensor.
        ValueError: for negative features, `block_size` < 1, an unknown `backend`, or a
            `block_mask` of the wrong shape or on the meta device.
    """

    row_ptr: Tensor
    col_idx: Tensor
    row_idx: Tensor
    col_ptr: Tensor
    t_perm: Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        block_mask: Tensor,
        block_size: int = 64,
        bias: bool = True,
        backend: Backend = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            check_int(name, value)
            if value < 0:
                raise ValueError(f"`{name}` ({value}) must be >= 0")
        check_int("block_size", block_size)
        if block_size < 1:
            raise ValueError(f"`block_size` ({block_size}) must be >= 1")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"`backend` ({backend!r}) must be 'auto', 'torch' or 'triton'")
        self.in_features = in_features
        self.out_features = out_features
        self.block_size = block_size
        self.backend: Backend = backend
        layout = BlockLayout.from_block_mask(
            block_mask, out_features=out_features, in_features=in_features,
            block_size=block_size,
        )  # fmt: skip
        # the device the factories pick (`device`, else a `with torch.device(...)` context)
        target = torch.empty(0, device=device).device
        for name in INDEX_FIELDS:
            self.register_buffer(name, getattr(layout, name).to(target))
        self._host_index: tuple[Tensor, ...] | None = None
        if target.type == "meta":  # the meta buffers hold no data: `_apply` restores from this
            self._host_index = tuple(t.cpu() for t in layout.index)
        factory: dict[str, Any] = {"device": target, "dtype": dtype}
        self.values = nn.Parameter(torch.empty(layout.nnzb, block_size, block_size, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's init (uniform ±1/√in_features) on the stored tiles and bias."""
        bound = 1.0 / max(1, self.in_features) ** 0.5
        with torch.no_grad():
            self.values.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)
            self._zero_padding()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Self:
        """`nn.Module._apply` (`.to()`, `to_empty()`, ...), keeping the tile index's data.

        The index buffers are structure, which `reset_parameters` cannot redraw: going onto
        the meta device keeps a host copy of them; coming off it (only `to_empty()` can,
        leaving uninitialised memory) copies that back into the new buffers.
        """
        old = [self._buffers[name] for name in INDEX_FIELDS]
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        new: list[Tensor] = [self._buffers[name] for name in INDEX_FIELDS]  # type: ignore[misc]
        was_meta, is_meta = old[0].is_meta, new[0].is_meta  # type: ignore[union-attr]
        if is_meta and not was_meta:
            self._host_index = tuple(t.cpu() for t in old)  # type: ignore[union-attr]
        elif was_meta and not is_meta:
            host = self.__dict__.get("_host_index")
            if host is None or [h.shape for h in host] != [t.shape for t in new]:
                raise RuntimeError(
                    "BlockSparseLinear: its tile index left the meta device without a host "
                    "copy of the same shapes; load it with load_state_dict(assign=True)"
                )
            with torch.no_grad():
                for t, h in zip(new, host, strict=True):
                    t.copy_(h)
        return self

    @torch.no_grad()
    def _zero_padding(self) -> None:
        # Edge tiles of non-multiple shapes: entries outside the weight stay exactly zero.
        values: Any = self.values
        if hasattr(values, "full_tensor"):  # FSDP2 (a DTensor of tiles): the whole, then the
            from torch.distributed.tensor import distribute_tensor  # shard of this rank

            dense = blocks_to_dense(values.full_tensor(), self.layout)
            padded = dense_to_blocks(dense, self.layout)
            mesh, placements = values.device_mesh, values.placements
            values.copy_(distribute_tensor(padded, mesh, placements, src_data_rank=None))
            return
        dense = blocks_to_dense(values, self.layout)
        values.copy_(dense_to_blocks(dense, self.layout))

    @property
    def layout(self) -> BlockLayout:
        """The tile index (tensors on the module's device).

        The same object while the index buffers are the same tensors, so launch plans cached on
        it (`BlockLayout.cached`) are built once; a new one after the buffers are replaced
        (`.to()`, assignment). In-place changes (`load_state_dict`) are seen by the cache.
        """
        bufs = self._buffers
        layout: BlockLayout | None = self.__dict__.get("_layout")
        if layout is None or any(
            t is not bufs[n] for n, t in zip(INDEX_FIELDS, layout.index, strict=True)
        ):
            layout = BlockLayout(
                out_features=self.out_features,
                in_features=self.in_features,
                block_size=self.block_size,
                **{name: bufs[name] for name in INDEX_FIELDS},  # type: ignore[arg-type]
            )
            self.__dict__["_layout"] = layout
        return layout

    @property
    def density(self) -> float:
        """Stored tiles / all tiles."""
        return self.layout.density

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        *,
        block_size: int = 64,
        sparsity: float = 0.9,
        block_mask: Tensor | None = None,
        backend: Backend = "auto",
    ) -> BlockSparseLinear:
        """Keep the `1 - sparsity` fraction of tiles with the largest mean |W| of `linear`.

        Args:
            linear: the dense layer (weight copied, bias kept).
            block_size: tile edge.
            sparsity: fraction of tiles dropped (exactly `round(sparsity · tiles)`).
            block_mask: explicit (row_blocks, col_blocks) bool tile mask instead of magnitude.
            backend: `"auto"`, `"torch"` or `"triton"`.

        Raises:
            TypeError: if `linear` is not an `nn.Linear`, or `block_size` is not an int.
            ValueError: for `block_size` < 1 or `sparsity` outside [0, 1).
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"`linear` must be an nn.Linear, got {type(linear).__name__}")
        check_int("block_size", block_size)
        if block_size < 1:
            raise ValueError(f"`block_size` ({block_size}) must be >= 1")
        weight = linear.weight.detach()
        sparsity_given = block_mask is None
        if block_mask is None:
            if not 0.0 <= sparsity < 1.0:
                raise ValueError(f"`sparsity` ({sparsity}) must be in [0, 1)")
            tiles = block_scores(weight.abs(), block_size)
            k = round(sparsity * tiles.numel())
            keep = torch.ones(tiles.numel(), dtype=torch.bool, device=tiles.device)
            if k:
                keep[torch.topk(tiles.flatten(), k, largest=False, sorted=False).indices] = False
            block_mask = keep.view_as(tiles)
        layer = cls(
            linear.in_features,
            linear.out_features,
            block_mask=block_mask,
            block_size=block_size,
            bias=linear.bias is not None,
            backend=backend,
            device=weight.device,
            dtype=weight.dtype,
        )
        if sparsity_given:
            warn_if_empty(block_mask, f"{linear} (from_dense)", sparsity)
        with torch.no_grad():
            layer.values.copy_(dense_to_blocks(weight, layer.layout))
            if linear.bias is not None and layer.bias is not None:
                layer.bias.copy_(linear.bias.detach())
        return layer

    def to_dense(self) -> Tensor:
        """The dense (out, in) weight with zeros outside the stored tiles (differentiable)."""
        return blocks_to_dense(self.values, self.layout)

    def to_linear(self) -> nn.Linear:
        """An `nn.Linear` with the same weight (zeros included) and bias (no RNG draw)."""
        linear: nn.Linear = nn.utils.skip_init(  # type: ignore[no-untyped-call]
            nn.Linear,
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=self.values.device,
            dtype=self.values.dtype,
        )
        with torch.no_grad():
            linear.weight.copy_(self.to_dense())
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def forward(self, x: Tensor) -> Tensor:
        """(..., in_features) -> (..., out_features)."""
        return block_sparse_linear(x, self.values, self.layout, self.bias, backend=self.backend)

    def extra_repr(self) -> str:
        """Shapes, block size, density, backend."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"block_size={self.block_size}, density={self.density:.3f}, "
            f"bias={self.bias is not None}, backend={self.backend!r}"
        )
