"""Multi-step parity with transformers' and torch's Adafactor, and with the T2T equations.

Yardstick: a float64 run of the reference. Ours (fp32) and the reference (fp32) start from the
same weights and see the same fresh random gradients for 50 steps; our error against the
float64 run (max abs, relative to the largest entry) must be at most 2x the reference's own
fp32 error, for the parameters and every state tensor (`assert_within_reference_error`).

Floor: 2x of 2 fp32 ulps (2^-22) of the tensor's largest entry. Where the reference's own error
is below 2 ulps it is luck in a handful of roundings, not a yardstick: on the 1- and 33-element
momentum buffers of `beta1_external_lr` the reference ends 0.66-0.78 ulp off and we 1.7-2.7 ulp
(50-step EMAs of the same lr-scaled updates, rounded in a different order). Measured over this
module's 489 comparisons: the reference's own error reaches 14 ulp, ours 14.3; only those two
need the floor; 296 (mostly the very accurate factor statistics) have reference errors under
2 ulp, where the bound is then 4 ulp.
"""

import math

import pytest
import torch
import transformers.optimization as hf_optimization

from leanlm_testing import assert_verbose_allclose
from leanlm_testing.optim import assert_within_reference_error
from optim_adafactor import Adafactor, factored

STEPS = 50
FLOOR = 2 * 2.0**-22  # 2x of 2 fp32 ulps, relative to the largest entry (see above)


def make_param(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64)


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
    """Initial weights in float64 (each run casts them to its own dtype)."""
    if shape_name == "noncontig":
        base = torch.randn(12, 9, dtype=torch.float64).t()  # (9, 12), strides (1, 9)
        assert not base.is_contiguous()
        return [base]
    return [make_param(SHAPES[shape_name])]


def random_grad(p: torch.Tensor, step: int) -> torch.Tensor:
    """Fresh float64 heteroscedastic gradient: per-row and per-column scales, a new scale."""
    g = torch.randn(p.shape, dtype=torch.float64)
    if p.dim() >= 2:
        g *= torch.rand(p.shape[:-1], dtype=torch.float64).add_(0.1).unsqueeze(-1)
        g *= torch.rand(p.shape[-1], dtype=torch.float64).add_(0.1)
    g *= 10.0 ** torch.empty(()).uniform_(-3, 1).item()
    if p.stride() != g.stride() and p.dim() == 2:
        g = g.t().contiguous().t()  # same (non-contiguous) layout as the param
    return g


def _leaf(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A leaf copy of `p` in `dtype` with `p`'s memory layout."""
    return (
        p.detach()
        .to(dtype, memory_format=torch.preserve_format)
        .clone(memory_format=torch.preserve_format)
        .requires_grad_()
    )


def run_against_float64(
    make_ref, make_ours, params, steps: int = STEPS, *, make_truth=None, check_state=True
):
    """Run the reference in float64 and fp32 and ours in fp32 on the same gradients.

    Asserts that our error against the float64 run is within 2x the reference's fp32 error,
    for every parameter and (with `check_state`) every state tensor of the same name.
    """
    truth = [_leaf(p, torch.float64) for p in params]
    theirs = [_leaf(p, torch.float32) for p in params]
    ours = [_leaf(p, torch.float32) for p in params]
    opts = [(make_truth or make_ref)(truth), make_ref(theirs), make_ours(ours)]
    for t in range(steps):
        for i, p in enumerate(truth):
            g = random_grad(p, t)
            truth[i].grad = g
            theirs[i].grad = g.to(torch.float32, memory_format=torch.preserve_format)
            ours[i].grad = g.to(torch.float32, memory_format=torch.preserve_format)
        for opt in opts:
            opt.step()
    ot, or_, oo = opts
    for i, (a, b, c) in enumerate(zip(ours, theirs, truth, strict=True)):
        assert a.dtype == torch.float32
        assert_within_reference_error(
            a.detach(), b.detach(), c.detach(), floor=FLOOR, name=f"param {i}"
        )
        if not check_state:
            continue
        st, sr, so = ot.state[c], or_.state[b], oo.state[a]
        assert so["step"] == sr["step"] == steps
        for key in ("exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq"):
            assert (key in so) == (key in sr), key
            if key in so:
                assert so[key].dtype == torch.float32
                assert_within_reference_error(
                    so[key], sr[key], st[key], floor=FLOOR, name=f"{key}[{i}]"
                )
    return ours, opts[2]


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


@pytest.mark.parametrize("chunk", [None, 30], ids=["one_sweep", "row_chunks"])
@pytest.mark.parametrize("shape_name", SHAPE_NAMES)
@pytest.mark.parametrize("combo", list(HF_COMBOS))
def test_matches_transformers(combo: str, shape_name: str, chunk, monkeypatch) -> None:
    if chunk is not None:  # the CPU sweeps by chunks of rows: 1 or 4 rows, 30 + 10 of 40 x 1
        monkeypatch.setattr(factored, "CPU_CHUNK", chunk)
    kw = HF_COMBOS[combo]
    run_against_float64(
        lambda ps: hf_optimization.Adafactor(ps, **kw),
        lambda ps: Adafactor(ps, **kw),
        _params(shape_name),
    )


def test_matches_transformers_many_params_and_groups() -> None:
    shapes = [(8, 6), (6,), (2, 3, 4), (5, 5)]
    params = [torch.randn(s, dtype=torch.float64) for s in shapes]

    def groups(ps):
        return [
            {"params": ps[:2]},
            {"params": ps[2:3], "beta1": 0.9, "weight_decay": 0.1},
            {"params": ps[3:], "lr": 1e-2, "relative_step": False, "scale_parameter": False},
        ]

    run_against_float64(
        lambda ps: hf_optimization.Adafactor(groups(ps)),
        lambda ps: Adafactor(groups(ps)),
        params,
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
    # torch's ε1 defaults to finfo(param dtype).eps: the float64 run gets the fp32 value, so
    # that it computes the same function
    truth_kw = {**kw, "eps": kw.get("eps", (torch.finfo(torch.float32).eps, 1e-3))}
    run_against_float64(
        lambda ps: torch.optim.Adafactor(ps, **kw, foreach=foreach, maximize=maximize),
        lambda ps: Adafactor.from_torch_args(ps, **kw, maximize=maximize),
        _params(shape_name),
        make_truth=lambda ps: torch.optim.Adafactor(
            ps, **truth_kw, foreach=foreach, maximize=maximize
        ),
        check_state=False,  # torch's state keys and shapes differ (keepdim row_var/col_var)
    )


@pytest.mark.parametrize("combo", ["default", "weight_decay", "maximize"])
def test_torch_preset_foreach_path_matches_torch_optim(combo: str, foreach_batches) -> None:
    """Every shape (and a non-contiguous one) in one batch of the multi-tensor path (on CPU)."""
    kw = dict(TORCH_COMBOS[combo])
    maximize = kw.pop("maximize", False)
    truth_kw = {**kw, "eps": (torch.finfo(torch.float32).eps, 1e-3)}
    params = [p for name in SHAPE_NAMES if name != "scalar" for p in _params(name)]
    run_against_float64(
        lambda ps: torch.optim.Adafactor(ps, **kw, foreach=True, maximize=maximize),
        lambda ps: Adafactor.from_torch_args(ps, **kw, maximize=maximize),
        params,
        make_truth=lambda ps: torch.optim.Adafactor(
            ps, **truth_kw, foreach=True, maximize=maximize
        ),
        check_state=False,
    )
    assert foreach_batches == [len(params)] * STEPS


def t2t_reference_step(p, g, state, *, scale_parameter, beta1, clip):
    """Tensor2Tensor's `_resource_apply_dense`, written from the paper / T2T equations.

    T2T factors a variable only when `len(shape) == 2` (`_should_use_factored_second_moment_
    estimate`); 1-D, 3-D and 4-D variables keep a full second moment.
    """
    state["t"] = t = state.get("t", 0) + 1
    decay = 1.0 - t**-0.8
    rho = min(t**-0.5, 1e-2)
    scale = rho * max(p.pow(2).mean().sqrt().item(), 1e-3) if scale_parameter else rho * 0.05
    g2 = g * g + 1e-30
    if p.dim() == 2:
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


@pytest.mark.parametrize("shape_name", ["1d", "odd", "3d", "4d"])
@pytest.mark.parametrize(
    "kw",
    [
        {"scale_parameter": True, "beta1": None, "clip": 1.0},
        {"scale_parameter": False, "beta1": None, "clip": 1.0},
        {"scale_parameter": True, "beta1": 0.9, "clip": None},
    ],
)
def test_t2t_preset_matches_equations(shape_name: str, kw: dict) -> None:
    """Judged against the equations in float64, by the equations' own fp32 error."""
    p0 = _params(shape_name)[0]
    truth, truth_state = p0.clone(), {}
    theirs, their_state = p0.float(), {}
    ours = p0.float().clone().requires_grad_()
    opt = Adafactor(
        [ours],
        semantics="t2t",
        scale_parameter=kw["scale_parameter"],
        beta1=kw["beta1"],
        clip_threshold=kw["clip"],
    )
    for t in range(STEPS):
        g = random_grad(truth, t)
        t2t_reference_step(truth, g, truth_state, **kw)
        t2t_reference_step(theirs, g.float(), their_state, **kw)
        ours.grad = g.float()
        opt.step()
    assert_within_reference_error(ours.detach(), theirs, truth, floor=FLOOR, name="t2t param")


@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 3, 4, 5), (6,), (5, 7)])
def test_t2t_factors_only_matrices(shape: tuple[int, ...]) -> None:
    """T2T's rule: a second moment is factored iff the variable has exactly 2 dims."""
    p = torch.randn(shape, requires_grad=True)
    opt = Adafactor([p], semantics="t2t")
    p.grad = torch.randn(shape)
    opt.step()
    state = opt.state[p]
    if len(shape) == 2:
        assert state["exp_avg_sq_row"].shape == shape[:1]
        assert state["exp_avg_sq_col"].shape == shape[1:]
        assert "exp_avg_sq" not in state
    else:
        # the full second moment after one step (β2_1 = 0): exactly g² + ε1
        assert set(state) == {"step", "exp_avg_sq"}
        assert torch.equal(state["exp_avg_sq"], p.grad.square() + 1e-30)


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
    """An external schedule drives `group["lr"]`; `step()` never writes it (nor does HF's)."""
    p0 = torch.randn(6, 5, dtype=torch.float64)
    kw = {"lr": 1e-2, "relative_step": False, "scale_parameter": True}
    runs = []
    for cls, dtype in [
        (hf_optimization.Adafactor, torch.float64),
        (hf_optimization.Adafactor, torch.float32),
        (Adafactor, torch.float32),
    ]:
        p = p0.detach().to(dtype).clone().requires_grad_()
        opt = cls([p], **kw)
        runs.append((p, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))))
    for t in range(20):
        g = torch.randn(6, 5, dtype=torch.float64)
        for p, opt, sched in runs:
            p.grad = g.to(p.dtype)
            lr_before = opt.param_groups[0]["lr"]
            opt.step()
            assert opt.param_groups[0]["lr"] == lr_before
            sched.step()
            assert math.isclose(opt.param_groups[0]["lr"], 1e-2 / (t + 2))
    (truth, _, _), (theirs, _, _), (ours, _, _) = runs
    assert_within_reference_error(ours.detach(), theirs.detach(), truth.detach(), floor=FLOOR)
