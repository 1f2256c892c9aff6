"""Behaviours every optimizer of the workspace must have, checked the same way for each.

Seeded runs over a fixed set of shapes (`SHAPES`: matrix, vector, 3-D tensor, scalar), state-dict
round trips, state buffers that alias nothing, parameters without gradients left alone, a step
without host syncs, closures, empty and 0-dim parameters. The optimizer packages pass their
optimizer (or a function that builds it) and its parameters.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
import torch

from leanlm_testing.optim import LOSSLESS_SHAPES, assert_within_reference_error

SHAPES = LOSSLESS_SHAPES


def shape_grads(seed: int) -> list[torch.Tensor]:
    """Seeded fp32 gradients, one per entry of `SHAPES`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def run_seeded(
    opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], seeds: Iterable[int]
) -> None:
    """One step per seed, with `shape_grads(seed)` (in each parameter's dtype) as gradients."""
    for seed in seeds:
        for p, g in zip(params, shape_grads(seed), strict=True):
            p.grad = g.to(p.dtype)
        opt.step()


def clone_leaves(
    params: Sequence[torch.Tensor], dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """Leaf copies of `params` that require grads, converted to `dtype` if given."""
    return [p.detach().to(dtype).clone().requires_grad_() for p in params]


def float64_copy(
    optimizer: Callable[..., Any],
    params: Sequence[torch.Tensor],
    state_dict: dict[str, Any],
    **kw: Any,
) -> tuple[Any, list[torch.Tensor]]:
    """`optimizer` on float64 copies of `params`, loaded from `state_dict` (state up-cast exactly).

    Returns the optimizer and its parameters: the float64 yardstick that continues a run.
    """
    params64 = clone_leaves(params, torch.float64)
    opt = optimizer(params64, **kw)
    opt.load_state_dict(copy.deepcopy(state_dict))
    return opt, params64


def check_state_dict_handover(
    ours: Callable[..., Any],
    theirs: Callable[..., Any],
    params: list[torch.Tensor],
    *,
    ours_first: bool,
    on_load: Callable[[Any, list[torch.Tensor]], None] | None = None,
    **kw: Any,
) -> None:
    """One implementation steps 10 times, the other loads its state dict and both go on.

    With `ours_first` ours steps `params` first and `theirs(copies, **kw)` loads its state
    dict, else the other way round; `on_load(opt, params)` may check the loading optimizer
    right after the load. Then both, and `theirs` in float64 from the same point (the
    yardstick), step 30 more times: ours must err at most 2x theirs
    (`assert_within_reference_error`).
    """
    first_cls, second_cls = (ours, theirs) if ours_first else (theirs, ours)
    first = first_cls(params, **kw)
    run_seeded(first, params, range(10))
    second_params = clone_leaves(params)
    second = second_cls(second_params, **kw)
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    if on_load is not None:
        on_load(second, second_params)
    truth, truth_params = float64_copy(theirs, params, first.state_dict(), **kw)
    for opt, ps in [(first, params), (second, second_params), (truth, truth_params)]:
        run_seeded(opt, ps, range(10, 40))
    ours_params, theirs_params = (params, second_params) if ours_first else (second_params, params)
    for a, b, c in zip(ours_params, theirs_params, truth_params, strict=True):
        assert_within_reference_error(a.detach(), b.detach(), c.detach())


def check_round_trip_continues_identically(
    make_opt: Callable[[list[torch.Tensor]], Any], params: list[torch.Tensor]
) -> Any:
    """10 steps, save the state dict, load it into a fresh optimizer; 15 more steps on each.

    Both runs' parameters and every state entry must then be equal (bit for bit). Returns the
    uninterrupted optimizer (stepping `params`).
    """
    opt = make_opt(params)
    run_seeded(opt, params, range(10))
    saved = copy.deepcopy(opt.state_dict())
    resumed_params = clone_leaves(params)
    resumed = make_opt(resumed_params)
    resumed.load_state_dict(saved)
    run_seeded(opt, params, range(10, 25))
    run_seeded(resumed, resumed_params, range(10, 25))
    for a, b in zip(params, resumed_params, strict=True):
        assert torch.equal(a, b)
        for key, value in opt.state[a].items():
            other = resumed.state[b][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
    return opt


def check_no_state_buffers_alias(opt: Any, params: list[torch.Tensor]) -> None:
    """After 3 steps no two state tensors (nor a state tensor and a parameter) share storage."""
    run_seeded(opt, params, range(3))
    tensors = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    ptrs = [t.untyped_storage().data_ptr() for t in tensors + params]
    assert len(ptrs) == len(set(ptrs))


def check_params_without_grads_are_skipped(opt: Any, params: list[torch.Tensor]) -> None:
    """`params[0]` never gets a gradient: 3 steps leave it unchanged and without state.

    The other parameters step (their state counts 3 steps).
    """
    frozen = params[0]
    before = frozen.detach().clone()
    for seed in range(3):
        for p, g in zip(params[1:], shape_grads(seed)[1:], strict=True):
            p.grad = g
        opt.step()
    assert frozen not in opt.state or len(opt.state[frozen]) == 0
    assert torch.equal(frozen, before)
    assert opt.state[params[1]]["step"] == 3


def check_step_makes_no_host_sync(
    opt: Any, params: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every host-sync entry point of a tensor raises inside two `step()`s."""
    for p, g in zip(params, shape_grads(0), strict=True):
        p.grad = g

    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("host sync in step()")

    for name in ("item", "__bool__", "__float__", "__int__", "tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    opt.step()
    opt.step()


def check_closure_is_called_with_grad_enabled(
    make_opt: Callable[[list[torch.Tensor]], Any],
) -> None:
    """`step(closure)` runs a closure that calls `backward()` and returns its loss."""
    p = torch.randn(3, 3, requires_grad=True)
    opt = make_opt([p])

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()  # type: ignore[no-untyped-call]
        return loss

    assert opt.step(closure) is not None
    assert p.grad is not None


def check_empty_and_zero_dim_params(make_opt: Callable[[list[torch.Tensor]], Any]) -> None:
    """A (0, 4) parameter and a 0-dim one step; the 0-dim one moves against its gradient."""
    params = [torch.zeros(0, 4, requires_grad=True), torch.tensor(1.5, requires_grad=True)]
    opt = make_opt(params)
    params[0].grad = torch.zeros(0, 4)
    params[1].grad = torch.tensor(0.3)
    opt.step()
    assert params[1].item() < 1.5


def check_construction_keeps_global_rng(make_opt: Callable[[list[torch.Tensor]], Any]) -> None:
    """Building the optimizer leaves torch's global random stream where it was.

    A seeded run that switches optimizers keeps its dropout masks and data order (HF's and
    torch's optimizers draw nothing at construction).
    """
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    make_opt([torch.zeros(3, 2, requires_grad=True)])
    assert torch.equal(torch.rand(4), expected)


def check_failed_param_group_is_not_added(opt: Any, bad_group: dict[str, Any], match: str) -> None:
    """`add_param_group(bad_group)` raises naming `match` (and the group) and adds nothing."""
    before = len(opt.param_groups)
    with pytest.raises((TypeError, ValueError), match=match) as info:
        opt.add_param_group(bad_group)
    assert f"param group {before}" in str(info.value)
    assert len(opt.param_groups) == before


def check_compiled_step(
    make_opt: Callable[[list[torch.Tensor]], Any],
    *,
    steps: int = 5,
    max_graphs: int = 3,
    dtype: torch.dtype = torch.float32,
    scheduler: Callable[[Any], Any] | None = None,
) -> None:
    """`torch.compile(opt.step)` settles on at most `max_graphs` graphs, within fp32 rounding.

    Over `steps` steps, against the eager step, with parameters and gradients in `dtype`
    (bf16: within one bf16 step, at most 5% of the elements off the eager ones: a reordered
    fp32 sum may round the other way). The step
    count must not be burnt into the graph (a graph per step until dynamo's recompile limit,
    then eager with a warning): torch's own compiled AdamW settles after one graph.

    `scheduler` (a function of the optimizer, e.g. a `LambdaLR` factory) is built before the
    step is compiled and stepped after every step, so that it writes a new float `lr` into the
    group each step (dynamo makes it a symbolic float from the second compile). The
    floating-point state must then agree too, to the same tolerance.
    """
    import torch._dynamo
    from torch._dynamo.utils import counters

    results = [_steps(make_opt, steps, compiled, dtype, scheduler) for compiled in (False, True)]
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= max_graphs, f"{graphs} graphs over {steps} steps"
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7  # bf16: one step of its 8-bit mantissa
    (eager_p, eager_s), (compiled_p, compiled_s) = results
    for eager, compiled_t in zip(eager_p, compiled_p, strict=True):
        assert compiled_t.dtype == dtype
        torch.testing.assert_close(compiled_t, eager, atol=tol, rtol=tol)
    if scheduler is not None:
        for i, (eager_state, compiled_state) in enumerate(zip(eager_s, compiled_s, strict=True)):
            for key, value in eager_state.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    name = f"param {i} state {key!r}"
                    torch.testing.assert_close(
                        compiled_state[key],
                        value,
                        atol=tol,
                        rtol=tol,
                        msg=functools.partial(_named_message, name),
                    )
    if dtype != torch.float32:  # rounded alike (other roundings would differ in ~half)
        differ = sum(int((e != c).sum()) for e, c in zip(eager_p, compiled_p, strict=True))
        assert differ <= 0.05 * sum(p.numel() for p in eager_p), differ


def _steps(
    make_opt: Callable[[list[torch.Tensor]], Any],
    steps: int,
    compiled: bool,
    dtype: torch.dtype,
    scheduler: Callable[[Any], Any] | None = None,
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    if compiled:
        torch._dynamo.reset()
        counters.clear()
    params = [torch.randn(s, generator=torch.Generator().manual_seed(0)).to(dtype) for s in SHAPES]
    opt = make_opt(params)
    sched = None if scheduler is None else scheduler(opt)
    step = torch.compile(opt.step) if compiled else opt.step
    for seed in range(steps):
        for p, g in zip(params, shape_grads(seed), strict=True):
            p.grad = g.to(dtype)
        step()
        if sched is not None:
            sched.step()
    return params, [dict(opt.state[p]) for p in params]


def _named_message(name: str, message: str) -> str:
    return f"{name}: {message}"


def _int8_steps(
    make_opt: Callable[[list[torch.Tensor]], Any],
    shapes: Sequence[tuple[int, ...]],
    *,
    compiled: bool,
    dtype: torch.dtype,
    steps: int = 3,
) -> tuple[list[torch.Tensor], list[Any], int, int]:
    """Parameters and states after `steps` steps, the number of graphs and of graph breaks."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    torch.manual_seed(0)  # the stochastic-rounding seed is drawn at construction
    opt = make_opt(params)
    step = torch.compile(opt.step) if compiled else opt.step
    for _ in range(steps):  # step 1: a static graph; from step 2 the step count is dynamic
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        step()
    graphs = int(counters["stats"]["unique_graphs"])
    breaks = sum(counters["graph_break"].values())
    return params, [opt.state[p] for p in params], graphs, breaks


#: One row (or 1-D) with a partial 128-block after full ones; several rows with partial blocks:
#: the shapes inductor miscompiled the int8 quantizer's functional forms on (torch 2.13, CPU).
INT8_COMPILE_SHAPES: tuple[tuple[int, ...], ...] = ((1, 300), (1, 130), (1, 257), (300,), (3, 300))


def check_compiled_int8_step(
    make_opt: Callable[[list[torch.Tensor]], Any],
    dtype: torch.dtype,
    shapes: Sequence[tuple[int, ...]] = INT8_COMPILE_SHAPES,
) -> None:
    """Over 3 steps: 3 graphs at most, no graph break, the eager step's int8 state to ulps.

    For an optimizer whose int8 first moment is `state["exp_avg"]` with `exp_avg_scale`
    (optim-adafactor's momentum, optim-came's first moment). Codes: equal but for at most one
    per tensor, by one. Scales: within 1e-6 relative (one fp32 ulp is 1.2e-7). Parameters: fp32
    within 1e-6 (lr 1e-3); bf16 within one bf16 step, at most 1% of the elements differing.
    """
    eager_p, eager_s, _, _ = _int8_steps(make_opt, shapes, compiled=False, dtype=dtype)
    comp_p, comp_s, graphs, breaks = _int8_steps(make_opt, shapes, compiled=True, dtype=dtype)
    assert 1 <= graphs <= 3, f"{graphs} graphs over 3 steps"
    assert breaks == 0
    for shape, pe, pc, se, sc in zip(shapes, eager_p, comp_p, eager_s, comp_s, strict=True):
        assert not pc.isnan().any(), shape
        if len(shape) >= 2:  # a vector's first moment stays fp32
            assert se["exp_avg"].dtype == sc["exp_avg"].dtype == torch.int8
            off = (sc["exp_avg"].int() - se["exp_avg"].int()).abs()
            assert int((off > 0).sum()) <= 1, (shape, off.nonzero())
            assert int(off.max()) <= 1, (shape, off.nonzero())
            torch.testing.assert_close(sc["exp_avg_scale"], se["exp_avg_scale"], rtol=1e-6, atol=0)
        if dtype == torch.float32:
            torch.testing.assert_close(pc, pe, rtol=0, atol=1e-6)
        else:
            torch.testing.assert_close(pc, pe, rtol=2.0**-7, atol=2.0**-7)
            assert int((pc != pe).sum()) <= 0.01 * pc.numel(), shape
