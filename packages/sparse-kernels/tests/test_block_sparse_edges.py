"""BlockSparseLinear at its edges, on every route the CPU has: wrong widths, 0 tokens, gradients of
gradients. Routes: the torch backend through torch's BSR product (tile density <= 0.3) or through
the dense weight (above), and the Triton kernels under the interpreter."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leanlm_testing import assert_verbose_allclose
from sparse_kernels import BlockSparseLinear
from sparse_kernels import _bsr_kernels as K
from sparse_kernels import _bsr_torch as T
from sparse_kernels.block_sparse import block_sparse_linear
from sparse_kernels.layout import dense_to_blocks

# route: (backend, tile sparsity); 64 -> 32 features in 16 x 16 tiles (8 tiles)
ROUTES = {
    "torch-bsr": ("torch", 0.875),  # 1 tile of 8: density 0.125, BSR product
    "torch-dense": ("torch", 0.5),  # density 0.5, through the dense weight
    "triton": ("triton", 0.5),
}
ROUTE_PARAMS = [
    "torch-bsr",
    "torch-dense",
    pytest.param("triton", marks=pytest.mark.interpreter),
]


def _layer(route: str, dtype: torch.dtype = torch.float32) -> BlockSparseLinear:
    backend, sparsity = ROUTES[route]
    if backend == "triton" and not K.available(torch.device("cpu")):
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    linear = nn.Linear(64, 32, dtype=dtype)
    layer = BlockSparseLinear.from_dense(linear, block_size=16, sparsity=sparsity, backend=backend)
    if backend == "torch":
        assert (layer.density > T.DENSE_CROSSOVER) == (route == "torch-dense")
    return layer


@pytest.mark.parametrize("route", ROUTE_PARAMS)
@pytest.mark.parametrize("features", [63, 65, 80])
def test_wrong_in_features_raise_on_every_route(route, features):
    layer = _layer(route)
    x = torch.randn(3, features)
    message = f"`x` has {features} features, expected 64"
    with pytest.raises(ValueError, match=message):
        layer(x)
    with pytest.raises(ValueError, match=message), torch.no_grad():
        layer(x)
    with pytest.raises(ValueError, match=message):
        block_sparse_linear(x, layer.values, layer.layout, backend=layer.backend)


def test_torch_products_reject_wrong_widths():
    layer = _layer("torch-bsr")
    x, dy = torch.randn(3, 65), torch.randn(3, 31)
    with pytest.raises(ValueError, match=r"`x` must be \(tokens, 64\)"):
        T.dsd_torch(x, layer.values.detach(), layer.layout, None)
    with pytest.raises(ValueError, match=r"`dy` must be \(tokens, 32\)"):
        T.dsdt_torch(dy, layer.values.detach(), layer.layout)
    with pytest.raises(ValueError, match=r"`x` must be \(tokens, 64\)"):
        T.sdd_torch(torch.randn(3, 32), x, layer.layout)


@pytest.mark.parametrize("route", ROUTE_PARAMS)
def test_empty_batch_gives_zero_gradients_as_nn_linear(route):
    layer = _layer(route)
    x = torch.randn(2, 0, 64, requires_grad=True)
    y = layer(x)
    assert y.shape == (2, 0, 32)
    y.sum().backward()
    assert x.grad is not None
    assert x.grad.shape == (2, 0, 64)
    assert torch.equal(layer.values.grad, torch.zeros_like(layer.values))
    assert torch.equal(layer.bias.grad, torch.zeros_like(layer.bias))


def _penalty_grads(module_or_weight, x, bias=None):
    """Gradients of two gradient-penalty losses: dL/dx taken with create_graph, then backward
    through it (dy that requires grad, and dy = 1 that does not)."""
    out = []
    for inner in (lambda y: y.square().sum(), lambda y: y.sum()):
        x1 = x.clone().requires_grad_(True)
        y = module_or_weight(x1) if bias is None else F.linear(x1, module_or_weight, bias)
        (gx,) = torch.autograd.grad(inner(y), x1, create_graph=True)
        (y.square().sum() + gx.square().sum()).backward()
        out.append(x1.grad)
    return out


@pytest.mark.parametrize("route", ROUTE_PARAMS)
def test_double_backward_matches_dense_linear(route):
    layer = _layer(route)
    weight = layer.to_dense().detach().clone().requires_grad_(True)
    bias = layer.bias.detach().clone().requires_grad_(True)
    x = torch.randn(4, 64)
    got_x = _penalty_grads(layer, x)
    ref_x = _penalty_grads(weight, x, bias)
    for got, ref in zip(got_x, ref_x, strict=True):
        assert_verbose_allclose(got, ref, atol=1e-5, rtol=1e-5, name="dL/dx")
    ref_tiles = dense_to_blocks(weight.grad, layer.layout)
    assert float(ref_tiles.abs().max()) > 1.0  # the penalty's own term is not negligible
    assert_verbose_allclose(layer.values.grad, ref_tiles, atol=1e-4, rtol=1e-5, name="dW")
    assert_verbose_allclose(layer.bias.grad, bias.grad, atol=1e-4, rtol=1e-5, name="db")


@pytest.mark.parametrize("route", ["torch-bsr", "torch-dense"])
def test_gradgradcheck_fp64(route):
    layer = _layer(route, torch.float64)
    x = torch.randn(3, 64, dtype=torch.float64, requires_grad=True)

    def f(x, values, bias):
        return block_sparse_linear(x, values, layer.layout, bias, backend="torch")

    inputs = (x, layer.values.detach().requires_grad_(True), layer.bias.detach().requires_grad_())
    assert torch.autograd.gradgradcheck(f, inputs)
