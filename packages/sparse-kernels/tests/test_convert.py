"""`to_masked_linear_` undoes `to_block_sparse_` exactly: masks, weights, biases, state dict."""

import pytest
import torch
from torch import nn

from leanlm_testing.models import random_batches, tiny_llama
from sparse_kernels import (
    BlockSparseLinear,
    SparsityConfig,
    get_mask,
    sparsify_,
    to_block_sparse_,
    to_masked_linear_,
)
from sparse_kernels.layout import dense_to_blocks
from sparse_kernels.sparsify import stored_weight


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


def test_masked_to_block_sparse_and_back_is_exact():
    model, copy = tiny_llama(), tiny_llama()
    copy.load_state_dict(model.state_dict())
    config = SparsityConfig(pattern="block", sparsity=0.5, block_size=16)
    sparsify_(model, config)
    sparsify_(copy, config)
    batch = random_batches(256, batches=1)[0]
    new = to_block_sparse_(model, block_size=16, backend="torch")
    assert new
    with torch.no_grad():  # the tiles trained: move them, so the way back carries new values
        for layer in new.values():
            layer.values.add_(dense_to_blocks(torch.ones_like(layer.to_dense()), layer.layout))
            if layer.bias is not None:
                layer.bias.add_(1.0)
    dense = {name: layer.to_dense().detach().clone() for name, layer in new.items()}
    expected = model(**batch).logits
    back = to_masked_linear_(model)
    assert back.keys() == new.keys()
    assert not any(isinstance(m, BlockSparseLinear) for m in model.modules())
    for name, linear in back.items():
        assert isinstance(linear, nn.Linear)
        assert torch.equal(linear.weight, dense[name])  # zeros outside the tiles, exact
        assert torch.equal(get_mask(linear), get_mask(copy.get_submodule(name)))
    torch.testing.assert_close(model(**batch).logits, expected, atol=1e-5, rtol=1e-5)
    # exactly the masked model holding those weights: same keys, dtypes and bits
    with torch.no_grad():
        for name in back:
            target = copy.get_submodule(name)
            stored_weight(target).copy_(dense[name])
            if target.bias is not None:
                target.bias.add_(1.0)
    _assert_same_state(model, copy)
    # and into block-sparse again: the same tiles
    again = to_block_sparse_(copy, block_size=16, backend="torch")
    for name, layer in again.items():
        assert torch.equal(layer.values, new[name].values), name
        assert torch.equal(layer.layout.block_mask(), new[name].layout.block_mask()), name


def test_to_masked_linear_of_a_single_layer_model_keeps_edge_tiles_cropped():
    # 45 x 51 with 16-wide tiles: partial edge tiles; the mask is cropped to the weight's shape
    parent = nn.Sequential(nn.Linear(51, 45))
    layer = BlockSparseLinear.from_dense(parent[0], block_size=16, sparsity=0.5, backend="torch")
    parent[0] = layer
    weight = layer.to_dense().detach().clone()
    mask = layer.layout.block_mask().repeat_interleave(16, 0).repeat_interleave(16, 1)
    (linear,) = to_masked_linear_(parent).values()
    assert parent[0] is linear
    assert torch.equal(get_mask(linear), mask[:45, :51])
    assert torch.equal(linear.weight, weight)
    assert torch.equal(linear.bias, layer.bias)
    assert linear.weight.dtype == layer.values.dtype


@pytest.mark.parametrize("block_size", [0, -4])
def test_block_size_below_one_is_rejected_before_use(block_size):
    message = rf"`block_size` \({block_size}\) must be >= 1"
    with pytest.raises(ValueError, match=message):
        BlockSparseLinear.from_dense(nn.Linear(32, 16), block_size=block_size, sparsity=0.5)
    model = tiny_llama()
    for sparsity in (0.5, None):
        with pytest.raises(ValueError, match=message):
            to_block_sparse_(model, block_size=block_size, sparsity=sparsity)
    assert not any(isinstance(m, BlockSparseLinear) for m in model.modules())
