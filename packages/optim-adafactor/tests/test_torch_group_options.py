"""A `torch.optim.Adafactor` state dict carries its group options `beta2_decay` and `d`.

Before, `Adafactor.from_torch_args(params).load_state_dict(torch_state_dict)` renamed torch's
state keys but not these group options: the group held torch's `beta2_decay`/`d` and the
constructor's `decay_rate`/`clip_threshold` side by side and stepped with the latter, a mix of
the checkpoint's `lr`/`eps`/`weight_decay` and the constructor's options (0.088 off torch's own
resume after 3 steps). They are now renamed, as torch's own resume uses them.
"""

import copy

import torch

from optim_adafactor import Adafactor

OPTIONS = {"lr": 0.5, "beta2_decay": -0.5, "d": 2.0, "weight_decay": 0.1}


def _params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in [(6, 5), (5,), (2, 3, 4)]]


def _step(opt: torch.optim.Optimizer, params: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
    opt.step()


def test_resume_from_a_torch_state_dict_uses_its_group_options() -> None:
    """float64: 3 steps of torch, then 3 of ours with defaults loading torch's state dict, equal
    torch's uninterrupted 6 steps (within float64 rounding; before: 0.088 off)."""
    truth = _params()
    truth_opt = torch.optim.Adafactor(truth, **OPTIONS)
    for seed in range(6):
        _step(truth_opt, truth, seed)

    first = _params()
    first_opt = torch.optim.Adafactor(first, **OPTIONS)
    for seed in range(3):
        _step(first_opt, first, seed)
    resumed = [p.clone() for p in first]
    ours = Adafactor.from_torch_args(resumed)  # torch's defaults: beta2_decay=-0.8, d=1.0
    ours.load_state_dict(copy.deepcopy(first_opt.state_dict()))

    for seed in range(3, 6):
        _step(ours, resumed, seed)
    for a, b in zip(resumed, truth, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    group = ours.param_groups[0]
    assert "beta2_decay" not in group
    assert "d" not in group
    assert (group["decay_rate"], group["clip_threshold"]) == (-0.5, 2.0)
    assert (group["lr"], group["weight_decay"], group["semantics"]) == (0.5, 0.1, "torch")


def test_a_group_with_both_names_keeps_ours() -> None:
    """A state dict saved after loading torch's one into an older version holds both names: the
    group keeps `decay_rate`/`clip_threshold`, the options its steps used, and drops torch's."""
    params = _params()
    opt = Adafactor.from_torch_args(params, beta2_decay=-0.7, d=1.5)
    _step(opt, params, 0)
    state_dict = copy.deepcopy(opt.state_dict())
    state_dict["param_groups"][0] |= {"beta2_decay": -0.5, "d": 2.0}
    other = Adafactor.from_torch_args([p.clone() for p in params])
    other.load_state_dict(state_dict)
    group = other.param_groups[0]
    assert (group["decay_rate"], group["clip_threshold"]) == (-0.7, 1.5)
    assert "beta2_decay" not in group
    assert "d" not in group
