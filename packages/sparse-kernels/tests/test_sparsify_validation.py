"""sparsify_ checks its targets before it changes the model, and its errors name the modules."""

import warnings

import pytest
import torch
from torch import nn

from leanlm_testing.models import random_batches, tiny_llama
from sparse_kernels import SparsityConfig, masks, sparsify_


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    assert masks(model) == {}
    after = model.state_dict()
    assert set(after) == set(before)  # no parametrization keys
    for key, value in before.items():
        assert torch.equal(after[key], value), key


@pytest.mark.parametrize(
    ("method", "sequential"),
    [("magnitude", False), ("wanda", False), ("wanda", True), ("sparsegpt", False),
     ("sparsegpt", True)],
)  # fmt: skip
def test_nm_shape_error_names_the_modules_before_any_change(method, sequential):
    model = tiny_llama(intermediate_size=90)  # down_proj: in_features 90, not a multiple of 4
    before = _snapshot(model)
    batches = random_batches(256, batches=1, seq_len=8)
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError, match="multiple of 4") as err:
        sparsify_(
            model,
            SparsityConfig(pattern="2:4", method=method),
            calibration=batches,
            sequential=sequential,
        )
    for i in (0, 1):
        assert f"model.layers.{i}.mlp.down_proj (in_features=90)" in str(err.value)
    assert "up_proj" not in str(err.value)
    assert calls == []  # no calibration pass ran
    _assert_unchanged(model, before)


class _TwoBlocks(nn.Module):
    """`blocks.1` is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_unreached_target_raises_a_value_error_naming_it_before_pruning(method):
    net = _TwoBlocks()
    before = _snapshot(net)
    with pytest.raises(ValueError, match=r"no calibration token reached blocks\.1:"):
        sparsify_(
            net,
            SparsityConfig(pattern="2:4", method=method),
            calibration=[{"x": torch.randn(4, 8)}],
        )
    _assert_unchanged(net, before)


class _Layer(nn.Module):
    def __init__(self, skip: bool) -> None:
        super().__init__()
        self.a, self.b, self.skip = nn.Linear(8, 8), nn.Linear(8, 8), skip

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.a(h) if self.skip else self.b(self.a(h))


class _Stack(nn.Module):
    """`layers.1.b` is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(False), _Layer(True)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_unreached_target_in_sequential_mode_names_it(method):
    net = _Stack()
    layer1 = _snapshot(net.layers[1])
    with pytest.raises(ValueError, match=r"no calibration token reached layers\.1\.b when layer 1"):
        sparsify_(
            net,
            SparsityConfig(pattern="2:4", method=method),
            calibration=[{"x": torch.randn(4, 8)}],
            sequential=True,
        )
    _assert_unchanged(net.layers[1], layer1)  # layer 0 is pruned by then, as documented


def test_a_block_sparsity_that_empties_a_layer_warns_naming_it():
    """round(sparsity x tiles) can be every tile of a small layer: its output is then 0.

    Before, `sparsify_` emptied such layers silently (GradualPruning and from_dense warned).
    """
    model = tiny_llama()  # q_proj 64x64: one 64x64 tile; 0.875 of 1 tile rounds to 1
    with pytest.warns(UserWarning, match="prunes every weight of") as caught:
        sparsify_(model, SparsityConfig(pattern="block", sparsity=0.875, block_size=64))
    assert any("`model.layers.0.self_attn.q_proj`" in str(w.message) for w in caught)
    assert not model.model.layers[0].self_attn.q_proj.weight.any()
    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        sparsify_(model, SparsityConfig(pattern="block", sparsity=0.5, block_size=16))
        sparsify_(tiny_llama(), SparsityConfig(pattern="2:4"))


def test_returned_masks_do_not_change_when_the_model_is_sparsified_again():
    """Before, the module kept the returned tensor itself and updated it in place: a second
    `sparsify_` (another pattern) rewrote the masks the first call had returned."""
    model = tiny_llama()
    first = sparsify_(model, SparsityConfig(pattern="2:4"))
    kept = {name: mask.clone() for name, mask in first.items()}
    second = sparsify_(model, SparsityConfig(pattern="block", sparsity=0.5, block_size=16))
    for name, mask in first.items():
        assert torch.equal(mask, kept[name]), name
    assert any(not torch.equal(second[n], kept[n]) for n in kept)
    assert all(torch.equal(masks(model)[n], second[n]) for n in second)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"block_size": 2.5}, r"`block_size` must be an int, got 2.5"),
     ({"block_size": True}, r"`block_size` must be an int, got True"),
     ({"sparsegpt_block": 64.0}, r"`sparsegpt_block` must be an int"),
     ({"sparsity": "0.5"}, r"`sparsity` must be a number, got '0.5'"),
     ({"dampening": None}, r"`dampening` must be a number, got None")],
)  # fmt: skip
def test_config_types_are_checked_naming_the_field(kwargs, match):
    # before: raw TypeErrors from a comparison or from torch, naming no field
    with pytest.raises(TypeError, match=match):
        SparsityConfig(**kwargs)


def test_block_sparse_from_dense_checks_block_size_type():
    from sparse_kernels import BlockSparseLinear

    with pytest.raises(TypeError, match=r"`block_size` must be an int, got 16.0"):
        BlockSparseLinear.from_dense(nn.Linear(32, 32), block_size=16.0, sparsity=0.5)
