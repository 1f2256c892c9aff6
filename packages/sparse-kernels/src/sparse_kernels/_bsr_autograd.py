"""`_BlockSparseMM`: the autograd Function behind `block_sparse_linear`, and its kernel choice.

`_forward` picks one kernel set per call (the sm_90 TMA/wgmma kernels of `_bsr_hopper` /
`_bsr_hopper_dw` where `_bsr_hopper.use_sm90` says so, else `_bsr_kernels` on the Triton backend
or `_bsr_torch` on the torch one); the backward reuses that choice for dX and dW's stored tiles.
A backward run with `create_graph=True` uses `_bsr_torch.differentiable_backward` instead.
`_autocasting` / `_autocast_off` are the autocast helpers the layer and the backward share.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from sparse_kernels import _bsr_hopper as H
from sparse_kernels import _bsr_hopper_dw as HW
from sparse_kernels import _bsr_kernels as K
from sparse_kernels import _bsr_torch as T
from sparse_kernels.layout import BlockLayout


def _stored(layout: BlockLayout) -> int:
    """Weight elements in stored tiles (nnzb · b²; a host integer, no device read)."""
    return layout.nnzb * layout.block_size**2


def _forward(
    x: Tensor, values: Tensor, bias: Tensor | None, layout: BlockLayout, backend: str
) -> tuple[Tensor, bool]:
    """(Y, whether the Hopper kernels ran): the forward of `_BlockSparseMM` on 2-D x.

    One kernel set per call: the backward (same tokens, dtype and device) reuses the choice.
    """
    sm90 = backend == "triton" and H.use_sm90(
        x.device, layout.block_size, x.dtype, x.shape[0], _stored(layout)
    )
    if sm90:
        return H.dsd_sm90(x, values, layout, bias), True
    if backend == "triton":
        return K.dsd_triton(x, values, layout, bias), False
    return T.dsd_torch(x, values, layout, bias), False


class _BlockSparseMM(torch.autograd.Function):
    """Y = X·Wᵀ + b for a block-sparse W; backward computes dX and the stored tiles of dW."""

    @staticmethod
    def forward(  # noqa: PLR0917 (autograd.Function signature)
        ctx: Any,
        x: Tensor,
        values: Tensor,
        bias: Tensor | None,
        layout: BlockLayout,
        backend: str,
    ) -> Tensor:
        ctx.layout = layout
        ctx.backend = backend
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, values)
        y, ctx.sm90 = _forward(x, values, bias, layout, backend)
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        with _autocast_off(dy.device.type):  # backward called inside autocast: no recasts
            if torch.is_grad_enabled():  # create_graph=True: a backward that is differentiable
                x, values = ctx.saved_tensors
                grads = T.differentiable_backward(dy, x, values, ctx.layout, ctx.needs_input_grad)
                return (*grads[:2], grads[2] if ctx.has_bias else None, None, None)
            return _BlockSparseMM._backward(ctx, dy)

    @staticmethod
    def _backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, values = ctx.saved_tensors
        layout: BlockLayout = ctx.layout
        dy = dy.contiguous()
        dx = dv = db = None
        sm90: bool = ctx.sm90
        if ctx.needs_input_grad[0]:
            if sm90:
                dx = H.dsdt_sm90(dy, values, layout)
            elif ctx.backend == "triton":
                dx = K.dsdt_triton(dy, values, layout)
            else:
                dx = T.dsdt_torch(dy, values, layout)
        if ctx.needs_input_grad[1]:
            if sm90:
                dv = HW.sdd_sm90(dy, x, layout, values)
            elif ctx.backend == "triton":
                dv = K.sdd_triton(dy, x, layout, values)
            else:
                dv = T.sdd_torch(dy, x, layout)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dv, db, None, None


def _autocasting(device_type: str) -> bool:
    """Whether autocast is on for `device_type` (False for types without autocast: meta)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Autocast disabled for `device_type` if it is enabled, else a no-op context."""
    if _autocasting(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
