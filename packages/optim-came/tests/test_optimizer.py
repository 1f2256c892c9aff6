"""State dicts (ours and came-pytorch's), aliasing and the research-note §3 bugs, skipped params,
param groups, argument validation, host syncs, bf16 first moment and stochastic rounding."""

from functools import partial

import pytest
import torch

from leanlm_testing import assert_verbose_allclose, optim
from leanlm_testing import optim_basics as basics
from optim_came import CAME

came_pytorch = pytest.importorskip("came_pytorch")

KW = {"lr": 1e-2, "weight_decay": 0.1}


def _params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in basics.SHAPES]


@pytest.mark.parametrize(
    "kw",
    [
        KW,
        {**KW, "bias_correction": True, "instability_init": 1.0},
        {**KW, "state_dtype": torch.bfloat16},
    ],
    ids=["default", "extras", "bf16_state"],
)
def test_state_dict_round_trip_continues_identically(kw) -> None:
    params = _params()
    opt = basics.check_round_trip_continues_identically(lambda ps: CAME(ps, **kw), params)
    assert opt.state[params[0]]["exp_avg"].dtype == kw.get("state_dtype", torch.float32)


def test_loads_came_pytorch_state_dict_and_continues_like_it() -> None:
    def on_load(ours, ours_params):
        assert "RMS" not in ours.state[ours_params[0]]
        assert ours.param_groups[0]["bias_correction"] is False  # defaults filled in

    # yardstick: came-pytorch in float64 from the same point (weights and state up-cast exactly)
    basics.check_state_dict_handover(
        CAME, came_pytorch.CAME, _params(), ours_first=False, on_load=on_load, **KW
    )


def test_came_pytorch_loads_our_state_dict_and_continues_like_us() -> None:
    basics.check_state_dict_handover(CAME, came_pytorch.CAME, _params(), ours_first=True, **KW)


def test_load_keeps_fp32_statistics_for_bf16_params() -> None:
    params = _params(torch.bfloat16)
    opt = CAME(params, lr=1e-3)
    basics.run_seeded(opt, params, range(2))
    other = CAME(basics.clone_leaves(params), lr=1e-3)
    other.load_state_dict(opt.state_dict())  # torch's default would cast the state to bf16
    for state in other.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                assert value.dtype == torch.float32


def test_no_state_buffers_alias() -> None:
    """ColossalAI's DistributedCAME aliases exp_avg_res_* to exp_avg_sq_* from step 2 on."""
    params = _params()
    opt = CAME(params, **KW)
    basics.check_no_state_buffers_alias(opt, params)
    state = opt.state[params[0]]
    assert not torch.equal(state["exp_avg_res_row"], state["exp_avg_sq_row"])


def test_vector_step_keeps_momentum_unscaled() -> None:
    """came-pytorch 0.1.2 / pytorch_optimizer scale `exp_avg` by lr in place on the 1-D path."""
    p = torch.zeros(8, requires_grad=True)
    lr, beta1 = 0.5, 0.9
    opt = CAME([p], lr=lr)
    g = torch.linspace(-1, 1, 8)
    expected_m = torch.zeros(8)
    expected_p = torch.zeros(8)
    v = torch.zeros(8)
    for _ in range(3):
        p.grad = g.clone()
        opt.step()
        v = 0.999 * v + 0.001 * (g * g + 1e-30)
        u = g / v.sqrt()
        u = u / max(1.0, u.square().mean().sqrt().item())
        expected_m = beta1 * expected_m + (1 - beta1) * u
        expected_p -= lr * expected_m
        assert_verbose_allclose(opt.state[p]["exp_avg"], expected_m, atol=1e-7, rtol=1e-6)
        assert_verbose_allclose(p, expected_p, atol=1e-7, rtol=1e-6)


def test_params_without_grads_are_skipped() -> None:
    params = _params()
    basics.check_params_without_grads_are_skipped(CAME(params, **KW), params)


def test_param_groups_use_their_own_options() -> None:
    a, b = _params()[:2]
    ref_a, ref_b = basics.clone_leaves([a, b])
    opt = CAME([{"params": [a], "lr": 1e-3}, {"params": [b], "weight_decay": 0.5}], lr=2e-2)
    single_a = CAME([ref_a], lr=1e-3)
    single_b = CAME([ref_b], lr=2e-2, weight_decay=0.5)
    for seed in range(5):
        g = basics.shape_grads(seed)
        a.grad, ref_a.grad, b.grad, ref_b.grad = g[0], g[0].clone(), g[1], g[1].clone()
        opt.step()
        single_a.step()
        single_b.step()
    assert torch.equal(a, ref_a)
    assert torch.equal(b, ref_b)


def test_lr_schedule_is_followed_and_group_lr_is_never_written() -> None:
    p = torch.randn(4, 4, requires_grad=True)
    opt = CAME([p], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: step / 4)  # lr 0 at step 0
    before = p.detach().clone()
    p.grad = torch.randn(4, 4)
    opt.step()
    assert torch.equal(p, before)  # lr = 0 is a valid (frozen) step
    for _ in range(3):
        sched.step()
        opt.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 3 / 4)


def test_step_makes_no_host_sync(monkeypatch) -> None:
    """Every host-sync entry point of a tensor raises inside step()."""
    params = _params()
    opt = CAME(params, **KW, bias_correction=True, state_dtype=torch.bfloat16)
    basics.check_step_makes_no_host_sync(opt, params, monkeypatch)


def test_closure_is_called_with_grad_enabled() -> None:
    basics.check_closure_is_called_with_grad_enabled(partial(CAME, lr=1e-3))


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="fp32-state"),
        pytest.param({"state_dtype": torch.int8, "stochastic_rounding": True}, id="int8-state-sr"),
    ],
)
def test_compiled_step_settles_on_a_few_graphs(options) -> None:
    """`torch.compile(opt.step)`: the step count is not burnt into the graph. With the int8
    first moment, inductor failed to compile the quantizer (C++ error) or, in Adafactor,
    flipped the codes' signs; the quantizer runs as a custom op under compile."""
    basics.check_compiled_step(partial(CAME, lr=1e-3, weight_decay=1e-2, **options))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.int8])
def test_compiled_step_with_bf16_params_and_stochastic_rounding(state_dtype) -> None:
    """Before, aot_autograd refused the compiled step ("input mutations on views with
    different dtypes": the rounding adds its noise through an int32 view); the rounding now
    runs as a custom op inside the compiled step, with the eager step's noise."""
    make = partial(
        CAME, lr=1e-3, weight_decay=1e-2, stochastic_rounding=True, state_dtype=state_dtype
    )
    basics.check_compiled_step(make, dtype=torch.bfloat16, max_graphs=3)


def test_empty_and_zero_dim_params() -> None:
    basics.check_empty_and_zero_dim_params(partial(CAME, lr=1e-2))


def test_zero_gradients_give_no_nan() -> None:
    params = _params()
    opt = CAME(params, lr=1e-2)
    for _ in range(3):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
    for p in params:
        assert torch.isfinite(p).all()


BAD_ARGS = [
    ({"lr": None}, TypeError, "`lr` is required"),
    ({"lr": -1.0}, ValueError, "`lr` (-1.0)"),
    ({"lr": "1e-3"}, TypeError, "`lr`"),
    ({"eps": (1e-30,)}, TypeError, "`eps`"),
    ({"eps": (-1.0, 1e-16)}, ValueError, "`eps[0]` (-1.0)"),
    ({"eps": (1e-30, -2.0)}, ValueError, "`eps[1]` (-2.0)"),
    ({"clip_threshold": 0.0}, ValueError, "`clip_threshold` (0.0)"),
    ({"betas": (0.9, 0.999)}, TypeError, "`betas`"),
    ({"betas": (1.0, 0.999, 0.9999)}, ValueError, "`betas[0]` (1.0)"),
    ({"betas": (0.9, 0.999, float("nan"))}, ValueError, "`betas[2]`"),
    ({"weight_decay": -0.1}, ValueError, "`weight_decay` (-0.1)"),
    ({"bias_correction": 1}, TypeError, "`bias_correction`"),
    ({"instability_init": -1.0}, ValueError, "`instability_init` (-1.0)"),
    ({"state_dtype": torch.float16}, TypeError, "`state_dtype` (torch.float16)"),
    ({"stochastic_rounding": "yes"}, TypeError, "`stochastic_rounding`"),
    ({"backend": "cuda"}, ValueError, "`backend` ('cuda')"),
]


@pytest.mark.parametrize(("kw", "exc", "match"), BAD_ARGS, ids=[str(k) for k, _, _ in BAD_ARGS])
def test_bad_arguments_raise_naming_the_argument(kw, exc, match) -> None:
    with pytest.raises(exc) as info:
        CAME([torch.randn(2, 2, requires_grad=True)], **{"lr": 1e-3, **kw})
    assert match in str(info.value)


def test_lr_is_required() -> None:
    with pytest.raises(TypeError):
        CAME([torch.randn(2, requires_grad=True)])  # type: ignore[call-arg]


def test_bad_param_group_option_raises() -> None:
    opt = CAME([torch.randn(2, requires_grad=True)], lr=1e-3)
    bad = {"params": [torch.randn(2, requires_grad=True)], "betas": (0.9, 2.0, 0.9)}
    basics.check_failed_param_group_is_not_added(opt, bad, r"`betas\[1\]` \(2.0\)")


def test_lr_may_come_from_every_param_group() -> None:
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(5, requires_grad=True)
    opt = CAME([{"params": [a], "lr": 1e-2}, {"params": [b], "lr": 3e-3}], lr=None)
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 3e-3]
    with pytest.raises(TypeError, match="param group 1: `lr` is required"):
        CAME([{"params": [a], "lr": 1e-2}, {"params": [b]}], lr=None)


def test_numpy_scalars_are_numbers() -> None:
    np = pytest.importorskip("numpy")
    p = torch.randn(2, 2, requires_grad=True)
    betas = (np.float32(0.9), np.float32(0.999), np.float32(0.9999))
    opt = CAME([p], lr=np.float32(1e-3), betas=betas)
    p.grad = torch.ones_like(p)
    opt.step()
    assert torch.isfinite(p).all()


def test_construction_keeps_global_rng() -> None:
    basics.check_construction_keeps_global_rng(lambda ps: CAME(ps, lr=1e-3))
    basics.check_construction_keeps_global_rng(
        lambda ps: CAME(ps, lr=1e-3, state_dtype=torch.int8, stochastic_rounding=True)
    )


def test_complex_params_rejected() -> None:
    with pytest.raises(TypeError, match="complex"):
        CAME([torch.randn(2, dtype=torch.complex64, requires_grad=True)], lr=1e-3)


def test_bf16_first_moment_halves_its_bytes_and_tracks_fp32() -> None:
    ref_params, params = _params(), _params()
    ref = CAME(ref_params, lr=1e-2)
    opt = CAME(params, lr=1e-2, state_dtype=torch.bfloat16)
    basics.run_seeded(ref, ref_params, range(30))
    basics.run_seeded(opt, params, range(30))
    for p in params:
        state = opt.state[p]
        assert state["exp_avg"].dtype == torch.bfloat16
        for key in ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_sq"):
            if key in state:
                assert state[key].dtype == torch.float32
    for a, b in zip(params, ref_params, strict=True):
        # bf16 rounds m to 8 bits each step (relative 2^-9): the trajectories stay close
        assert_verbose_allclose(a, b, atol=2e-2, rtol=2e-2)


def test_stochastic_rounding_keeps_sub_ulp_updates_in_expectation() -> None:
    optim.check_sr_keeps_sub_ulp_updates(
        # lr 1e-2: updates of 8e-4 on average, 3.3e-3 at most, all below half an ulp (3.9e-3),
        # so round to nearest loses nearly every one, and large enough that the mean of 300
        # stochastically rounded steps resolves them (a rounding that is not stochastic fails)
        lambda ps, sr: CAME(ps, lr=1e-2, instability_init=1.0, stochastic_rounding=sr),
        min_lost=0.99,  # (a value just above 1.0 has a smaller ulp below it)
    )
