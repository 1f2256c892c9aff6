"""Review fixes: operand checks of `block_sparse_linear`, export of block-sparse models, and the
warning when a sparsity < 1 rounds to a whole layer."""

import re
import warnings

import pytest
import torch
from torch import nn

from sparse_kernels import (
    BlockSparseLinear,
    SparsityConfig,
    block_sparse_linear,
    load_compressed_,
    save_compressed,
    save_pretrained_sparse,
    sparsify_,
    to_block_sparse_,
)
from sparse_kernels import _bsr_kernels as K
from sparse_kernels.schedules import GradualPruning

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.interpreter)]


def _skip_without_triton(backend):
    if backend == "triton" and not K.available(torch.device("cpu")):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")


class _Blocks(nn.Module):
    def __init__(self, *shapes: tuple[int, int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(i, o) for i, o in shapes])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("numel", [5, 31, 33])
def test_bias_of_the_wrong_length_raises_on_every_backend(backend, numel):
    _skip_without_triton(backend)
    layer = BlockSparseLinear.from_dense(nn.Linear(32, 32), block_size=16, sparsity=0.5)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match=re.escape(f"`bias` shape ({numel},) must be (32,)")):
        block_sparse_linear(x, layer.values, layer.layout, torch.ones(numel), backend=backend)
    with pytest.raises(ValueError, match=re.escape("`bias` shape (1, 32) must be (32,)")):
        block_sparse_linear(x, layer.values, layer.layout, torch.ones(1, 32), backend=backend)
    meta = torch.ones(32, device="meta")
    with pytest.raises(ValueError, match="`bias` is on meta but `values` on cpu"):
        block_sparse_linear(x, layer.values, layer.layout, meta, backend=backend)
    y = block_sparse_linear(x, layer.values, layer.layout, torch.ones(32), backend=backend)
    expected = block_sparse_linear(x, layer.values, layer.layout, None, backend=backend) + 1
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.bfloat16, torch.float64])
def test_input_of_another_dtype_raises_type_error_on_every_backend(backend, dtype):
    _skip_without_triton(backend)
    layer = BlockSparseLinear.from_dense(
        nn.Linear(48, 40), block_size=16, sparsity=0.5, backend=backend
    )
    x = torch.randint(-3, 4, (2, 48)).to(dtype)
    message = f"`x` dtype {dtype} must equal `values` dtype torch.float32"
    with pytest.raises(TypeError, match=re.escape(message)):
        layer(x)
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        nn.Linear(48, 40)(x)  # what nn.Linear does with the same input


def _block_sparse_model() -> nn.Module:
    model = _Blocks((32, 32), (32, 16))
    sparsify_(model, SparsityConfig(pattern="block", sparsity=0.5, block_size=16))
    to_block_sparse_(model, block_size=16, backend="torch")
    return model


def test_exports_reject_block_sparse_layers_naming_them(tmp_path):
    model = _block_sparse_model()
    names = "layers.0, layers.1"
    with pytest.raises(ValueError, match=re.escape("`save_pretrained_sparse` does not handle")):
        save_pretrained_sparse(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"`save_compressed` does not handle BlockSparseLinear layers ({names}): call "
            "`to_masked_linear_(model)` first"
        ),
    ):
        save_compressed(model, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()
    masked = _Blocks((32, 32), (32, 16))
    sparsify_(masked, SparsityConfig(pattern="block", sparsity=0.5, block_size=16))
    save_compressed(masked, tmp_path / "m.safetensors")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape("`load_compressed_` does not handle")):
        load_compressed_(model, tmp_path / "m.safetensors")
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # untouched


def test_sparsify_keeps_the_documented_count_even_for_a_whole_layer_and_warns():
    # leanlm's block-sparse stage relies on the count (it keeps an all-pruned Linear masked)
    model = _Blocks((64, 64), (512, 64))
    config = SparsityConfig(pattern="block", sparsity=0.875, block_size=64)
    with pytest.warns(UserWarning, match="prunes every weight of `layers.0`") as caught:
        sparsify_(model, config)
    assert len(caught) == 1  # not layers.1
    assert not model.layers[0].weight.any()  # round(0.875 · 1) = 1 tile of 1
    assert model.layers[1].weight.any()  # round(0.875 · 8) = 7 tiles of 8


def test_from_dense_and_gradual_pruning_warn_for_an_empty_layer():
    with pytest.warns(UserWarning, match=r"prunes every weight of `Linear\(in_features=128"):
        layer = BlockSparseLinear.from_dense(nn.Linear(128, 64), block_size=64, sparsity=0.75)
    assert layer.density == 0.0  # the documented count round(0.75 · 2) = 2 tiles is kept
    model = _Blocks((64, 64))
    sched = GradualPruning(
        model, final_sparsity=0.75, end_step=1, frequency=1, pattern="block", block_size=64
    )
    with pytest.warns(UserWarning, match="sparsity 0.75 prunes every weight of `layers.0`"):
        sched.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BlockSparseLinear.from_dense(nn.Linear(128, 64), block_size=64, sparsity=0.25)
