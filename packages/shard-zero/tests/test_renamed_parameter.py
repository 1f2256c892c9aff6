"""A parametrization added or removed after `prepare` renames a Parameter: the error says so."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from leanlm_testing.distributed import single_process_group
from shard_zero import ZeroConfig, full_state_dict, prepare


class _Mask(nn.Module):
    """A mask parametrization like sparse_kernels' `WeightMask` (a boolean buffer)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(shape, dtype=torch.bool))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.mask


def _net(masked: bool) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    if masked:
        parametrize.register_parametrization(net[0], "weight", _Mask((8, 8)))
    return net


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(0))).sum().backward()
    opt.step()
    opt.zero_grad()


def _remove(model: nn.Module) -> None:
    parametrize.remove_parametrizations(model[0], "weight", leave_parametrized=True)


def _add(model: nn.Module) -> None:
    parametrize.register_parametrization(model[0], "weight", _Mask((8, 8)))


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(
    ("masked", "change", "new", "old"),
    [
        (True, _remove, "0.weight", "0.parametrizations.weight.original"),
        (False, _add, "0.parametrizations.weight.original", "0.weight"),
    ],
    ids=["removed", "added"],
)
def test_renamed_parameter_is_named_as_such(tmp_path, stage, masked, change, new, old):
    with single_process_group("cpu", tmp_path):
        model, opt = prepare(
            _net(masked),
            lambda ps: torch.optim.AdamW(ps, lr=1e-2),
            ZeroConfig(stage=stage, min_shard_numel=0),
        )
        _step(model, opt)
        change(model)
        message = (
            f"shard-zero: the model's parameters changed after `prepare` ({new!r} is {old!r} "
            "renamed). Its masters, gradient buckets and optimizer hold the parameters "
            "`prepare` saw, by name: register parametrizations (e.g. sparse_kernels' masks: "
            "`sparsify_`, a schedule) before `prepare` and keep them to the end. Adding or "
            "removing one mid-run (e.g. SparseThenDense at `dense_step`, `remove_masks_`) is "
            "not supported under shard-zero; to go dense, keep the parametrizations and fill "
            "their masks with ones instead"
        )
        # before: "{new!r} is a new Parameter ... cast, move or resize the model ... before
        # `prepare`": it is the same Parameter object, and casting has nothing to do with it
        with pytest.raises(RuntimeError, match=re.escape(message)):
            _step(model, opt)


def test_a_new_parameter_keeps_its_message(tmp_path):
    with single_process_group("cpu", tmp_path):
        model, opt = prepare(
            _net(False),
            lambda ps: torch.optim.AdamW(ps, lr=1e-2),
            ZeroConfig(stage=2, min_shard_numel=0),
        )
        _step(model, opt)
        model[2] = nn.Linear(8, 1)
        with pytest.raises(RuntimeError, match=r"'2\.weight' is a new Parameter\)\. .*: cast, "):
            _step(model, opt)


@pytest.mark.parametrize("stage", [2, 3])
def test_filling_the_mask_with_ones_goes_dense(tmp_path, stage):
    """The remedy the message names trains on: the masked rows then get their gradients."""
    key = "0.parametrizations.weight.original"
    with single_process_group("cpu", tmp_path):
        net = _net(True)
        mask = net[0].parametrizations.weight[0].mask
        mask[:4] = False
        model, opt = prepare(
            net,
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0),
            ZeroConfig(stage=stage, min_shard_numel=0),
        )
        _step(model, opt)
        before = full_state_dict(model)[key]
        _step(model, opt)
        masked = full_state_dict(model)[key]
        assert torch.equal(masked[:4], before[:4])  # no gradient through the zeros
        assert not torch.equal(masked[4:], before[4:])
        mask.fill_(True)
        _step(model, opt)
        dense = full_state_dict(model)[key]
        assert (dense[:4] != masked[:4]).any()
