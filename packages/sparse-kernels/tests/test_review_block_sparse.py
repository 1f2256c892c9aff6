"""Review fixes for `BlockSparseLinear`, `block_sparse_linear` and the mask functions.

* `values` that do not match the layout raise the Triton launcher's `ValueError` on the torch
  backend too (it read out of bounds: garbage or a segfault);
* bad arguments raise errors that name them (features, a non-bool `block_mask`, a non-Linear
  into `from_dense`, float `block_size` / `n` / `m` into the mask functions);
* meta-device init (`device="meta"` or `with torch.device("meta")`, then `to_empty()` and
  `reset_parameters()`) keeps the tile index.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from leanlm_testing import spawn
from sparse_kernels import (
    BlockLayout,
    BlockSparseLinear,
    GradualPruning,
    block_mask,
    block_sparse_linear,
    nm_mask,
)
from sparse_kernels._triton import available
from sparse_kernels.layout import blocks_to_dense, dense_to_blocks

# 4 of 16 tiles of 16 on a 64 x 64 weight (below the torch path's 0.3 dense crossover)
_SPARSE = torch.zeros(4, 4, dtype=torch.bool)
_SPARSE[0, 1] = _SPARSE[1, 2] = _SPARSE[2, 0] = _SPARSE[3, 3] = True
# 10 of 16 tiles (above the crossover: the dense route)
_DENSE = torch.ones(4, 4, dtype=torch.bool)
_DENSE[0, :3] = _DENSE[3, 1:4] = False


def _backends() -> list[str]:
    cpu_triton = available(torch.device("cpu"))
    return ["torch", "auto", *(["triton"] if cpu_triton else [])]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("mask", [_SPARSE, _DENSE], ids=["bsr", "dense-route"])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize(
    ("extra", "edge"), [(-1, 16), (1, 16), (0, 8)], ids=["fewer", "more", "edge8"]
)
def test_values_shape_checked_on_every_backend(backend, mask, grad, extra, edge):
    layout = BlockLayout.from_block_mask(mask, out_features=64, in_features=64, block_size=16)
    values = torch.randn(layout.nnzb + extra, edge, edge, requires_grad=grad)
    x = torch.randn(3, 64, requires_grad=grad)
    got, nnzb = f"{layout.nnzb + extra}, {edge}, {edge}", layout.nnzb
    want = rf"^`values` shape \({got}\) must be \({nnzb}, 16, 16\)$"
    with pytest.raises(ValueError, match=want):
        block_sparse_linear(x, values, layout, backend=backend)


def test_values_device_checked_on_the_torch_backend():
    layout = BlockLayout.from_block_mask(_SPARSE, out_features=64, in_features=64, block_size=16)
    values = torch.randn(layout.nnzb, 16, 16, device="meta")
    with pytest.raises(ValueError, match=r"^`x` is on cpu but `values` on meta$"):
        block_sparse_linear(torch.randn(3, 64), values, layout, backend="torch")


def test_matching_values_still_run():
    layout = BlockLayout.from_block_mask(_SPARSE, out_features=64, in_features=64, block_size=16)
    values = torch.randn(layout.nnzb, 16, 16, dtype=torch.float64)
    x = torch.randn(3, 64, dtype=torch.float64)
    ref = x @ blocks_to_dense(values, layout).T
    torch.testing.assert_close(block_sparse_linear(x, values, layout, backend="torch"), ref)


# ------------------------------------------------------------------------------ bad arguments
def test_mask_functions_name_float_ints():
    w = torch.randn(8, 16)
    with pytest.raises(TypeError, match=r"^`block_size` must be an int, got 2\.5$"):
        block_mask(w, 2.5, 0.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^`n` must be an int, got 2\.0$"):
        nm_mask(w, 2.0, 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^`m` must be an int, got 4\.0$"):
        nm_mask(w, 2, 4.0)  # type: ignore[arg-type]
    assert int(nm_mask(w, 2, 4).sum()) == 64
    assert int(block_mask(w, 4, 0.5).sum()) == 64


def test_features_must_be_ints():
    tiles = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"^`in_features` must be an int, got 40\.0$"):
        BlockSparseLinear(40.0, 16, block_mask=tiles, block_size=8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^`out_features` must be an int, got 16\.0$"):
        BlockSparseLinear(40, 16.0, block_mask=tiles, block_size=8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^`in_features` \(-8\) must be >= 0$"):
        BlockSparseLinear(-8, 16, block_mask=tiles, block_size=8)


def test_block_mask_must_be_bool():
    want = r"^`block_mask` must be a bool tensor \(True = stored tile\), got dtype torch.float32$"
    scores = torch.full((2, 5), 0.2)  # scores passed as the mask kept every tile before
    with pytest.raises(TypeError, match=want):
        BlockSparseLinear(40, 16, block_mask=scores, block_size=8)
    with pytest.raises(TypeError, match=want):
        BlockSparseLinear.from_dense(nn.Linear(40, 16), block_size=8, block_mask=scores)
    with pytest.raises(TypeError, match=want.replace("float32", "int64")):
        BlockLayout.from_block_mask(
            torch.ones(2, 5, dtype=torch.long), out_features=16, in_features=40, block_size=8
        )
    with pytest.raises(TypeError, match=r"got list$"):
        BlockLayout.from_block_mask(
            [[True]],  # type: ignore[arg-type]
            out_features=8,
            in_features=8,
            block_size=8,
        )
    layer = BlockSparseLinear(40, 16, block_mask=scores > 0.5, block_size=8)
    assert layer.density == 0.0


def test_from_dense_names_a_non_linear():
    with pytest.raises(TypeError, match=r"^`linear` must be an nn.Linear, got Conv1d$"):
        BlockSparseLinear.from_dense(nn.Conv1d(16, 16, 1), block_size=8)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- meta device
# 20 x 13 with 8 x 8 tiles: partial edge tiles, so reset_parameters zeroes padding by the index
_TILES = torch.tensor([[1, 0], [0, 1], [1, 1]], dtype=torch.bool)


def _cpu_layer(seed: int) -> BlockSparseLinear:
    torch.manual_seed(seed)
    return BlockSparseLinear(13, 20, block_mask=_TILES, block_size=8, backend="torch")


def _assert_same(layer: BlockSparseLinear, ref: BlockSparseLinear) -> None:
    for name, t in ref.state_dict().items():
        assert torch.equal(layer.state_dict()[name], t), name
    x = torch.randn(4, 13)
    assert torch.equal(layer(x), ref(x))
    assert torch.equal(layer.layout.block_mask(), _TILES)


def test_meta_device_to_empty_reset_parameters():
    layer = BlockSparseLinear(13, 20, block_mask=_TILES, block_size=8, device="meta")
    assert layer.values.is_meta
    assert layer.row_ptr.is_meta
    torch.manual_seed(1)
    torch.randn(1000).sum()  # garbage in freed memory for to_empty to pick up
    layer.to_empty(device="cpu")
    torch.manual_seed(3)
    layer.reset_parameters()
    layer.backend = "torch"
    _assert_same(layer, _cpu_layer(3))


def test_meta_context_to_empty_reset_parameters():
    with torch.device("meta"):
        layer = BlockSparseLinear(13, 20, block_mask=_TILES, block_size=8, backend="torch")
    assert layer.values.is_meta
    assert all(t.is_meta for t in layer.buffers())
    layer.to_empty(device="cpu")
    torch.manual_seed(5)
    layer.reset_parameters()
    _assert_same(layer, _cpu_layer(5))


def test_meta_round_trip_keeps_a_loaded_index():
    """`.to("meta")` keeps the index the layer holds then (here: loaded from another mask)."""
    other = torch.tensor([[0, 1], [1, 1], [1, 0]], dtype=torch.bool)  # same tile count
    torch.manual_seed(0)
    src = BlockSparseLinear(13, 20, block_mask=other, block_size=8, backend="torch")
    layer = _cpu_layer(1)
    layer.load_state_dict(src.state_dict())
    layer.to("meta").to_empty(device="cpu")
    torch.manual_seed(2)
    layer.reset_parameters()
    assert torch.equal(layer.layout.block_mask(), other)
    torch.manual_seed(2)
    src.reset_parameters()
    assert torch.equal(layer.values, src.values)
    assert torch.equal(layer.bias, src.bias)


def test_meta_block_mask_is_refused():
    with torch.device("meta"), pytest.raises(ValueError, match=r"`block_mask` is on the meta"):
        BlockSparseLinear(13, 20, block_mask=torch.ones(3, 2, dtype=torch.bool), block_size=8)


def test_numpy_and_tensor_integers_are_ints():
    """`operator.index` integers, as nn.Linear and torch's sizes take them (a NumPy step count);
    the int checks of the review fixes refused them at first."""
    import numpy as np

    layer = BlockSparseLinear(
        np.int64(32), np.int64(16), block_mask=torch.ones(1, 2, dtype=torch.bool), block_size=16
    )
    assert (layer.in_features, layer.out_features) == (32, 16)
    schedule = GradualPruning(
        nn.Sequential(nn.Linear(8, 8)),
        final_sparsity=0.5,
        start_step=np.int64(0),
        end_step=np.int64(4),
        frequency=np.int64(2),
        targets=["0"],
    )
    assert schedule.sparsity_at(4) == 0.5
    with pytest.raises(TypeError, match=r"`end_step` must be an int, got 4.0"):
        GradualPruning(
            nn.Sequential(nn.Linear(8, 8)), final_sparsity=0.5, end_step=4.0, targets=["0"]
        )


def _fsdp2_meta_init_worker(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    mask = torch.tensor([[True, False], [True, True], [False, True]])  # 48 x 20: edge tiles
    with torch.device("meta"):
        layer = BlockSparseLinear(20, 48, block_mask=mask, block_size=16, backend="torch")
    fully_shard(layer, mesh=mesh)
    layer.to_empty(device="cpu")
    torch.manual_seed(3)
    layer.reset_parameters()  # before: "mixed torch.Tensor and DTensor"
    full = layer.values.full_tensor()  # type: ignore[operator]
    bias = layer.bias.full_tensor()  # type: ignore[union-attr,operator]
    x = torch.randn(5, 20, generator=torch.Generator().manual_seed(0))
    y = layer(x)
    if rank == 0:
        torch.save(
            {"values": full, "bias": bias, "y": y.detach(), "index": layer.layout.index}, path
        )
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2])
def test_fsdp2_meta_init_reset_parameters_zeroes_the_padding(tmp_path, world_size):
    """The torchtitan order (meta, `fully_shard`, `to_empty`, `reset_parameters`): the tiles'
    entries outside the 48 x 20 weight are exactly zero, and the forward equals the dense
    masked product of the same tiles."""
    path = str(tmp_path / "out.pt")
    spawn(_fsdp2_meta_init_worker, path, world_size=world_size, tmp_path=tmp_path)
    out = torch.load(path)
    mask = torch.tensor([[True, False], [True, True], [False, True]])
    want = BlockSparseLinear(20, 48, block_mask=mask, block_size=16, backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(out["index"], want.layout.index, strict=True))
    layout = want.layout
    dense = blocks_to_dense(out["values"], layout)  # (48, 20): the padding is cut off
    assert torch.equal(dense_to_blocks(dense, layout), out["values"])  # padding exactly zero
    assert (out["values"] != 0).sum() == (dense != 0).sum() > 0
    x = torch.randn(5, 20, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out["y"], x @ dense.T + out["bias"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", [4.0, torch.tensor(4.0), True], ids=["float", "float-0d", "bool"])
def test_non_integers_stay_refused(value):
    with pytest.raises(TypeError, match=r"`end_step` must be an int"):
        GradualPruning(nn.Sequential(nn.Linear(8, 8)), final_sparsity=0.5, end_step=value)
