"""Multi-step parity with transformers' and torch's Adafactor, and with the T2T equations.

Tolerances: both sides run the same formulas in fp32 but with different operation order
(e.g. mean(g²)+ε vs mean(g²+ε), Σu² via a mat-vec), so each step differs by a few ulp; over 50
steps with the clip active this stays below rtol=1e-5 / atol=1e-6 (params of RMS ~1).
"""

import math

import pytest
import torch
import transformers.optimization as hf_optimization

from leanlm_testing import assert_verbose_allclose
from optim_adafactor import Adafactor

STEPS = 50
RTOL, ATOL = 1e-5, 1e-6


def make_param(shape: tuple[int, ...], *, noncontig: bool = False) -> torch.Tensor:
    if noncontig:  # a transposed leaf: non-contiguous param and grads
        return torch.randn(*reversed(shape)).t().detach().contiguous().t().t().detach()
    return torch.randn(shape)


SHAPES = {
    "1d": (33,),
    "square": (16, 16),
    "odd": (13, 7),
    "skinny_row": (1, 40),
    "skinny_col": (40, 1),
    "3d": (3, 5, 7),
    "4d": (2, 3, 4, 5),
    "scalar": (),
}


def _params(shape_name: str) -> list[torch.Tensor]:
    if shape_name == "noncontig":
        base = torch.randn(12, 9).t().detach()  # (9, 12), strides (1, 9)
        assert not base.is_contiguous()
        return [base]
    return [make_param(SHAPES[shape_name])]


def random_grad(p: torch.Tensor, step: int) -> torch.Tensor:
    """Fresh heteroscedastic gradient: per-row and per-column scales, a new overall scale."""
    g = torch.randn(p.shape)
    if p.dim() >= 2:
        g *= torch.rand(p.shape[:-1]).add_(0.1).unsqueeze(-1) * torch.rand(p.shape[-1]).add_(0.1)
    g *= 10.0 ** torch.empty(()).uniform_(-3, 1)
    if p.stride() != g.stride() and p.dim() == 2:
        g = g.t().contiguous().t()  # same (non-contiguous) layout as the param
    return g


def run_pair(make_a, make_b, params: list[torch.Tensor], steps: int = STEPS, check_state=None):
    pa = [
        p.clone().requires_grad_()
        if p.is_contiguous()
        else p.detach().clone(memory_format=torch.preserve_format).requires_grad_()
        for p in params
    ]
    pb = [
        p.clone().requires_grad_()
        if p.is_contiguous()
        else p.detach().clone(memory_format=torch.preserve_format).requires_grad_()
        for p in params
    ]
    oa, ob = make_a(pa), make_b(pb)
    for t in range(steps):
        for a, b in zip(pa, pb, strict=True):
            g = random_grad(a, t)
            a.grad = g.clone(memory_format=torch.preserve_format)
            b.grad = g.clone(memory_format=torch.preserve_format)
        oa.step()
        ob.step()
    for i, (a, b) in enumerate(zip(pa, pb, strict=True)):
        assert_verbose_allclose(b, a, atol=ATOL, rtol=RTOL, name=f"param {i}")
        if check_state is not None:
            check_state(oa.state[a], ob.state[b], i)
    return pa, pb, oa, ob


def check_hf_state(sa, sb, i):
    assert sb["step"] == sa["step"]
    for key in ("exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq"):
        assert (key in sa) == (key in sb), key
        if key in sa:
            assert sb[key].dtype == torch.float32
            # states span many magnitudes and exp_avg is a signed EMA that cancels near zero:
            # rtol plus an atol relative to the tensor's own scale
            atol = RTOL * float(sa[key].abs().max())
            assert_verbose_allclose(sb[key], sa[key], atol=atol, rtol=RTOL, name=f"{key}[{i}]")


HF_COMBOS = {
    "default": {},
    "warmup_init": {"warmup_init": True},
    "no_param_scale": {"scale_parameter": False},
    "external_lr": {"lr": 1e-2, "relative_step": False, "scale_parameter": False},
    "external_lr_scaled": {"lr": 0.3, "relative_step": False, "scale_parameter": True},
    "beta1": {"beta1": 0.9},
    "beta1_external_lr": {
        "beta1": 0.8,
        "lr": 1e-2,
        "relative_step": False,
        "scale_parameter": False,
    },
    "weight_decay": {"weight_decay": 0.1},
    "weight_decay_lr": {"weight_decay": 0.05, "lr": 3e-2, "relative_step": False},
    "clip_tight": {"clip_threshold": 0.5},
    "clip_loose": {"clip_threshold": 1e3, "lr": 1e-3, "relative_step": False},
    "decay_rate": {"decay_rate": -0.5, "eps": (1e-20, 1e-2)},
    "everything": {"beta1": 0.5, "weight_decay": 0.01, "warmup_init": True, "clip_threshold": 2.0},
}
SHAPE_NAMES = [*SHAPES, "noncontig"]


@pytest.mark.parametrize("shape_name", SHAPE_NAMES)
@pytest.mark.parametrize("combo", list(HF_COMBOS))
def test_matches_transformers(combo: str, shape_name: str) -> None:
    kw = HF_COMBOS[combo]
    run_pair(
        lambda ps: hf_optimization.Adafactor(ps, **kw),
        lambda ps: Adafactor(ps, **kw),
        _params(shape_name),
        check_state=check_hf_state,
    )


def test_matches_transformers_many_params_and_groups() -> None:
    shapes = [(8, 6), (6,), (2, 3, 4), (5, 5)]
    params = [torch.randn(s) for s in shapes]

    def groups(ps):
        return [
            {"params": ps[:2]},
            {"params": ps[2:3], "beta1": 0.9, "weight_decay": 0.1},
            {"params": ps[3:], "lr": 1e-2, "relative_step": False, "scale_parameter": False},
        ]

    run_pair(
        lambda ps: hf_optimization.Adafactor(groups(ps)),
        lambda ps: Adafactor(groups(ps)),
        params,
        check_state=check_hf_state,
    )


TORCH_COMBOS = {
    "default": {},
    "lr_cap": {"lr": 1e-3},
    "weight_decay": {"weight_decay": 0.1, "lr": 5e-3},
    "d": {"d": 1.5},
    "beta2_decay": {"beta2_decay": -0.5},
    "eps": {"eps": (1e-20, 1e-2)},
    "maximize": {"maximize": True},
}


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("shape_name", [n for n in SHAPE_NAMES if n != "scalar"])
@pytest.mark.parametrize("combo", list(TORCH_COMBOS))
def test_torch_preset_matches_torch_optim(combo: str, shape_name: str, foreach: bool) -> None:
    kw = dict(TORCH_COMBOS[combo])
    maximize = kw.pop("maximize", False)
    run_pair(
        lambda ps: torch.optim.Adafactor(ps, **kw, foreach=foreach, maximize=maximize),
        lambda ps: Adafactor.from_torch_args(ps, **kw, maximize=maximize),
        _params(shape_name),
    )


def t2t_reference_step(p, g, state, *, scale_parameter, beta1, clip):
    """Tensor2Tensor's `_resource_apply_dense`, written from the paper / T2T equations."""
    state["t"] = t = state.get("t", 0) + 1
    decay = 1.0 - t**-0.8
    rho = min(t**-0.5, 1e-2)
    scale = rho * max(p.pow(2).mean().sqrt().item(), 1e-3) if scale_parameter else rho * 0.05
    g2 = g * g + 1e-30
    if p.dim() >= 2:
        vr = state["vr"] = decay * state.get("vr", 0.0) + (1 - decay) * g2.mean(-1)
        vc = state["vc"] = decay * state.get("vc", 0.0) + (1 - decay) * g2.mean(-2)
        r = (vr / vr.mean(-1, keepdim=True)).rsqrt()
        x = g * r.unsqueeze(-1) * vc.rsqrt().unsqueeze(-2)
    else:
        v = state["v"] = decay * state.get("v", 0.0) + (1 - decay) * g2
        x = g * v.rsqrt()
    if clip is not None:
        x = x / max(1.0, x.pow(2).mean().sqrt().item() / clip)
    sub = scale * x
    if beta1:
        sub = state["m"] = beta1 * state.get("m", 0.0) + (1 - beta1) * sub
    p -= sub


@pytest.mark.parametrize("shape_name", ["1d", "odd", "3d"])
@pytest.mark.parametrize(
    "kw",
    [
        {"scale_parameter": True, "beta1": None, "clip": 1.0},
        {"scale_parameter": False, "beta1": None, "clip": 1.0},
        {"scale_parameter": True, "beta1": 0.9, "clip": None},
    ],
)
def test_t2t_preset_matches_equations(shape_name: str, kw: dict) -> None:
    p0 = _params(shape_name)[0].double()
    ref, ref_state = p0.clone(), {}
    ours = p0.float().clone().requires_grad_()
    opt = Adafactor(
        [ours],
        semantics="t2t",
        scale_parameter=kw["scale_parameter"],
        beta1=kw["beta1"],
        clip_threshold=kw["clip"],
    )
    for t in range(STEPS):
        g = random_grad(ours, t)
        t2t_reference_step(
            ref,
            g.double(),
            ref_state,
            **{"scale_parameter": kw["scale_parameter"], "beta1": kw["beta1"], "clip": kw["clip"]},
        )
        ours.grad = g
        opt.step()
    # reference in float64: ours differs by fp32 rounding only
    assert_verbose_allclose(ours, ref, atol=ATOL, rtol=RTOL, name="t2t param")


def test_bf16_params_match_transformers() -> None:
    """bf16 params: fp32 math, round-to-nearest write back, like HF; state stays fp32."""
    params = [torch.randn(16, 12).bfloat16(), torch.randn(12).bfloat16()]
    pa = [p.clone().requires_grad_() for p in params]
    pb = [p.clone().requires_grad_() for p in params]
    oa = hf_optimization.Adafactor(pa, beta1=0.9)
    ob = Adafactor(pb, beta1=0.9)
    for _ in range(10):
        for a, b in zip(pa, pb, strict=True):
            g = torch.randn(a.shape, dtype=torch.bfloat16)
            a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    for a, b in zip(pa, pb, strict=True):
        assert b.dtype == torch.bfloat16
        # one bf16 ulp (2^-8 relative) of slack for a rounding tie broken differently
        assert_verbose_allclose(b, a, atol=1e-3, rtol=2**-7, name="bf16 param")
        for value in ob.state[b].values():
            if isinstance(value, torch.Tensor):
                assert value.dtype == torch.float32


def test_lr_schedule_changes_are_used_and_lr_never_written() -> None:
    params = [torch.randn(6, 5)]
    pa = [p.clone().requires_grad_() for p in params]
    pb = [p.clone().requires_grad_() for p in params]
    kw = {"lr": 1e-2, "relative_step": False, "scale_parameter": True}
    oa, ob = hf_optimization.Adafactor(pa, **kw), Adafactor(pb, **kw)
    sa = torch.optim.lr_scheduler.LambdaLR(oa, lambda t: 1.0 / (1 + t))
    sb = torch.optim.lr_scheduler.LambdaLR(ob, lambda t: 1.0 / (1 + t))
    for t in range(20):
        g = torch.randn(6, 5)
        pa[0].grad, pb[0].grad = g.clone(), g.clone()
        oa.step()
        lr_before = ob.param_groups[0]["lr"]
        ob.step()
        assert ob.param_groups[0]["lr"] == lr_before
        sa.step()
        sb.step()
        assert math.isclose(ob.param_groups[0]["lr"], 1e-2 / (t + 2))
    assert_verbose_allclose(pb[0], pa[0], atol=ATOL, rtol=RTOL)
