"""Stochastic rounding of bf16 parameters: unbiased in expectation, keeps sub-ulp updates."""

import pytest
import torch

from leanlm_testing import optim
from optim_adafactor import Adafactor
from optim_adafactor._stochastic import copy_stochastic_


def _one_step(p0: torch.Tensor, g: torch.Tensor, **kw) -> torch.Tensor:
    p = p0.clone().requires_grad_()
    opt = Adafactor([p], lr=1e-3, relative_step=False, scale_parameter=False, **kw)
    p.grad = g.to(p.dtype)
    opt.step()
    return p.detach()


def test_mean_of_rounded_updates_matches_fp32_update() -> None:
    optim.check_sr_keeps_sub_ulp_updates(
        lambda ps, sr: Adafactor(
            ps, lr=1e-3, relative_step=False, scale_parameter=False, stochastic_rounding=sr
        )
    )


def test_stochastic_rounding_only_rounds_to_neighbours() -> None:
    x = torch.rand(1000) * 10 - 5
    out = torch.empty(1000, dtype=torch.bfloat16)
    copy_stochastic_(out, x.clone())
    down = x.bfloat16().float()  # nearest; neighbours are nearest and the next one over
    ulp = torch.where(x.abs() > 0, 2.0 ** (torch.floor(torch.log2(x.abs())) - 7), 1e-30)
    assert ((out.float() - x).abs() <= ulp * 1.0001).all()
    assert ((out.float() - down).abs() <= ulp * 1.0001).all()


def test_stochastic_rounding_rejects_wrong_dtypes() -> None:
    with pytest.raises(TypeError, match="bf16"):
        copy_stochastic_(torch.empty(3), torch.zeros(3))


def test_stochastic_rounding_is_ignored_for_fp32_params() -> None:
    p0 = torch.randn(8, 8)
    g = torch.randn(8, 8)
    assert torch.equal(_one_step(p0, g, stochastic_rounding=True), _one_step(p0, g))


def test_rounding_noise_is_fresh_per_step_and_per_parameter_yet_reproducible() -> None:
    """The noise is a function of (seed, step, index): new each step and for each parameter,
    the same for an optimizer that loaded the state dict (a resume continues it exactly)."""
    gen = torch.Generator().manual_seed(0)
    p0 = (1.0 + torch.rand(32, 48, generator=gen)).bfloat16()  # ulp 2^-7, updates below half
    g = torch.randn(32, 48, generator=gen).bfloat16()
    params = [p0.clone().requires_grad_() for _ in range(2)]
    kw = {"lr": 1e-3, "relative_step": False, "scale_parameter": False}
    opt = Adafactor(params, stochastic_rounding=True, **kw)
    moved = []
    for _ in range(2):
        before = [p.detach().clone() for p in params]
        for p in params:
            p.grad = g.clone()
        opt.step()
        moved.append([(p.detach() != b) for p, b in zip(params, before, strict=True)])
    assert 0.05 < moved[0][0].float().mean() < 0.95  # some elements rounded away, some not
    assert not torch.equal(moved[0][0], moved[1][0])  # step 2's noise is not step 1's
    assert not torch.equal(moved[0][0], moved[0][1])  # the second parameter's is its own
    resumed = [p.detach().clone().requires_grad_() for p in params]
    again = Adafactor(resumed, stochastic_rounding=True, **kw)
    again.load_state_dict(opt.state_dict())
    for p, q in zip(params, resumed, strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    again.step()
    assert all(torch.equal(p, q) for p, q in zip(params, resumed, strict=True))
