"""Numerical parity: with `came_pytorch.CAME` 0.1.3 (defaults) and with a float64 reference
written from the equations (the opt-in extras), over >= 100 steps of fresh random gradients.

Yardstick: a float64 run of the reference. came-pytorch runs in float64 and in fp32, ours in
fp32, from the same weights on the same gradients; our error against the float64 run (max abs,
relative to the largest entry) must be at most 2x came-pytorch's own fp32 error, for the
parameter and every state tensor (`assert_within_reference_error`; its floor of about one
fp32 ulp was never needed: measured, our error is at most 1.2x came-pytorch's
in all 87 comparisons, its own error reaching 115 ulps of the largest entry and ours
53). The opt-in extras have no independent reference; they are judged against the equations
run in float64 and in fp32 the same way.
"""

import math

import pytest
import torch

came_pytorch = pytest.importorskip("came_pytorch")

from leanlm_testing.optim import assert_within_reference_error  # noqa: E402
from optim_adafactor import factored  # noqa: E402
from optim_came import CAME  # noqa: E402

SHAPES = {
    "vector": (33,),
    "square_odd": (17, 17),
    "wide_odd": (7, 29),
    "skinny_1xk": (1, 37),
    "skinny_kx1": (41, 1),
    "3d": (3, 5, 6),
    "scalar": (),
}
STEPS = 100


def _grad(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    if len(shape) >= 2:  # heteroscedastic rows and columns make the factors matter
        g *= torch.rand(shape[:-1], generator=gen, dtype=torch.float64).add_(0.1).unsqueeze(-1)
        g *= torch.rand(shape[-1:], generator=gen, dtype=torch.float64).add_(0.1)
    return g * 10.0 ** (torch.rand((), generator=gen).item() * 4 - 3)


def _run(opt_cls, shape, dtype, steps, **kw):
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    opt = opt_cls([p], **kw)
    for _ in range(steps):
        p.grad = _grad(shape, gen).to(dtype)
        opt.step()
    return p.detach(), opt.state[p]


@pytest.mark.parametrize("chunk", [None, 40], ids=["one_sweep", "row_chunks"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_matches_came_pytorch_over_100_steps(
    shape_name: str, weight_decay: float, chunk, monkeypatch
) -> None:
    if chunk is not None:  # the CPU sweeps by chunks of rows (1 or 2 rows; 40 + 1 of 41 x 1)
        monkeypatch.setattr(factored, "CPU_CHUNK", chunk)
    shape = SHAPES[shape_name]
    kw = {"lr": 3e-3, "weight_decay": weight_decay}
    truth, true_state = _run(came_pytorch.CAME, shape, torch.float64, STEPS, **kw)
    theirs, their_state = _run(came_pytorch.CAME, shape, torch.float32, STEPS, **kw)
    ours, our_state = _run(CAME, shape, torch.float32, STEPS, **kw)
    assert_within_reference_error(ours, theirs, truth, name="param")
    assert our_state.keys() == their_state.keys() - {"RMS"}
    for key, value in their_state.items():
        if key in ("step", "RMS"):
            continue
        assert our_state[key].dtype == torch.float32
        assert_within_reference_error(our_state[key], value, true_state[key], name=key)
    assert our_state["step"] == their_state["step"] == STEPS
    assert "RMS" not in our_state  # came-pytorch computes it every step and never uses it


def _reference(shape, steps, *, lr, eps=(1e-30, 1e-16), d=1.0, betas=(0.9, 0.999, 0.9999),
               wd=0.0, bias_correction=False, init=0.0, dtype=torch.float64):  # fmt: skip
    """CAME written from the equations (paper Alg. 2 + came-pytorch's choices), in `dtype`."""
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    b1, b2, b3 = betas
    factored = len(shape) >= 2
    m = torch.zeros(shape, dtype=dtype)
    if factored:
        r = torch.zeros(shape[:-1], dtype=dtype)
        c = torch.zeros(shape[:-2] + shape[-1:], dtype=dtype)
        R, C = torch.full_like(r, init), torch.full_like(c, init)
    else:
        v = torch.zeros(shape, dtype=dtype)

    def approx(row, col):  # (row_i col_j / mean(row))
        return row.unsqueeze(-1) * col.unsqueeze(-2) / row.mean(-1, keepdim=True).unsqueeze(-1)

    for t in range(1, steps + 1):
        g = _grad(shape, gen).to(dtype)
        bc2 = 1 - b2**t if bias_correction else 1.0
        bc3 = 1 - b3**t if bias_correction and init == 0 else 1.0
        if factored:
            r = b2 * r + (1 - b2) * (g * g + eps[0]).mean(-1)
            c = b2 * c + (1 - b2) * (g * g + eps[0]).mean(-2)
            u = g / approx(r / bc2, c / bc2).sqrt()
        else:
            v = b2 * v + (1 - b2) * (g * g + eps[0])
            u = g / (v / bc2).sqrt()
        u = u / max(1.0, u.square().mean().sqrt().item() / d)
        m = b1 * m + (1 - b1) * u
        if factored:
            U = (u - m) ** 2 + eps[1]
            R = b3 * R + (1 - b3) * U.mean(-1)
            C = b3 * C + (1 - b3) * U.mean(-2)
            step = m / approx(R / bc3, C / bc3).sqrt()
        else:
            step = m
        p = p - lr * wd * p - lr * step
    return p


EXTRAS = {
    "defaults": {},
    "bias_correction": {"bias_correction": True},
    "instability_init": {"init": 1.0},
    "both_wd_clip": {"bias_correction": True, "init": 1.0, "wd": 0.05, "d": 0.5},
    "llama_betas": {"betas": (0.9, 0.95, 0.995), "bias_correction": True},
}


@pytest.mark.parametrize("extra", list(EXTRAS))
@pytest.mark.parametrize("shape_name", ["vector", "wide_odd", "3d"])
def test_options_match_float64_reference(shape_name: str, extra: str) -> None:
    shape, kw = SHAPES[shape_name], dict(EXTRAS[extra])
    truth = _reference(shape, STEPS, lr=3e-3, **kw)
    theirs = _reference(shape, STEPS, lr=3e-3, dtype=torch.float32, **kw)
    ours_kw = {
        "lr": 3e-3,
        "weight_decay": kw.pop("wd", 0.0),
        "clip_threshold": kw.pop("d", 1.0),
        **kw,
    }
    if "init" in ours_kw:
        ours_kw["instability_init"] = ours_kw.pop("init")
    ours, _ = _run(CAME, shape, torch.float32, STEPS, **ours_kw)
    assert_within_reference_error(ours, theirs, truth, name=extra)


def _first_step_rms(**kw) -> float:
    gen = torch.Generator().manual_seed(3)
    p = torch.zeros(64, 96, requires_grad=True)
    opt = CAME([p], lr=1.0, **kw)
    p.grad = torch.randn(64, 96, generator=gen) * torch.rand(64, 1, generator=gen)
    opt.step()
    return p.detach().square().mean().sqrt().item()


def test_instability_init_removes_first_step_spike() -> None:
    """came-pytorch's first matrix step is ~(1-β1)/(β1·sqrt(1-β3)) = 11.1 lr (research §1.7)."""
    spike = _first_step_rms()
    assert spike == pytest.approx((1 - 0.9) / (0.9 * math.sqrt(1 - 0.9999)), rel=0.05)
    assert _first_step_rms(instability_init=1.0) < 0.11  # ~ (1-β1)·RMS(û) = 0.1 lr
    assert _first_step_rms(bias_correction=True) < 0.13  # m / |û - m| ~ 0.1 / 0.9
