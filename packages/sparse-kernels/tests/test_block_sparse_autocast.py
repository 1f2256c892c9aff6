"""`BlockSparseLinear` under autocast computes as `nn.Linear` does (issue 24).

Reference: a masked dense `nn.Linear` (the layer's `to_dense()` weight) under the same CPU bf16
autocast: x, weight and bias cast to bf16, bf16 output, fp32 parameter gradients through the
casts. Tolerances: bf16 outputs of sums in a different order, (1e-2, 1.6e-2) as in
test_block_sparse.py; the gradients of the fp32 parameters are bf16 sums cast to fp32, so
the same.
"""

import pytest
import torch
from torch import nn

from leanlm_testing import assert_verbose_allclose
from sparse_kernels import BlockSparseLinear
from sparse_kernels import _bsr_kernels as K
from sparse_kernels.block_sparse import _BlockSparseMM, _forward
from sparse_kernels.layout import dense_to_blocks

BF16_TOL = {"atol": 1e-2, "rtol": 1.6e-2}
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.interpreter)]


def _layer(backend, bias=True):
    if backend == "triton" and not K.available(torch.device("cpu")):
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    linear = nn.Linear(51, 45, bias=bias)  # odd shapes: partial edge tiles
    return BlockSparseLinear.from_dense(linear, block_size=16, sparsity=0.5, backend=backend)


def _masked_dense(layer):
    dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    with torch.no_grad():
        dense.weight.copy_(layer.to_dense())
        if layer.bias is not None:
            dense.bias.copy_(layer.bias)
    return dense


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_forward_and_grads_match_masked_linear(backend, x_dtype):
    layer = _layer(backend)
    dense = _masked_dense(layer)
    x = torch.randn(3, 7, 51).to(x_dtype)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    g = torch.randn(3, 7, 45).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, ref = layer(x1), dense(x2)
        assert y.dtype == ref.dtype == torch.bfloat16
        # backward inside the autocast region too (the layer's backward must not recast)
        y.backward(g)
        ref.backward(g)
    assert_verbose_allclose(y.float(), ref.float(), **BF16_TOL, name="forward")
    assert layer.values.grad.dtype == layer.bias.grad.dtype == torch.float32
    assert x1.grad.dtype == x_dtype
    tiles = dense_to_blocks(dense.weight.grad, layer.layout)
    assert_verbose_allclose(layer.values.grad, tiles, **BF16_TOL, name="dW")
    assert_verbose_allclose(layer.bias.grad, dense.bias.grad, **BF16_TOL, name="db")
    assert_verbose_allclose(x1.grad.float(), x2.grad.float(), **BF16_TOL, name="dX")


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_without_grad_is_the_same_forward(backend):
    """Inference under autocast (the evaluation's no_grad path) gives the grad path's bits."""
    layer = _layer(backend, bias=False)
    x = torch.randn(9, 51)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        with torch.no_grad():
            y0 = layer(x)
    assert y0.dtype == torch.bfloat16
    assert torch.equal(y0, y.detach())


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_autocast_changes_no_bits(backend):
    """Outside autocast (or with it disabled) the layer runs the kernels on its own dtypes."""
    layer = _layer(backend)
    x = torch.randn(9, 51, requires_grad=True)
    g = torch.randn(9, 45)
    expected = _BlockSparseMM.apply(x, layer.values, layer.bias, layer.layout, backend)
    dx, dv, db = torch.autograd.grad(expected, (x, layer.values, layer.bias), g)
    for context in (torch.autocast("cpu", enabled=False), torch.enable_grad()):
        with context:
            y = layer(x)
        assert y.dtype == torch.float32
        assert torch.equal(y, expected)
        assert torch.equal(
            y, _forward(x.detach(), layer.values, layer.bias, layer.layout, backend)[0]
        )
        grads = torch.autograd.grad(y, (x, layer.values, layer.bias), g)
        for got, want in zip(grads, (dx, dv, db), strict=True):
            assert torch.equal(got, want)
