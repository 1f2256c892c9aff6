"""Checks of an optimizer's multi-tensor fused step against its PyTorch path and itself.

The optimizer packages pass their optimizer class; it takes `backend=` ("torch" or "triton"),
has a `multi_tensor` switch and a `_sr_seed` (the stochastic-rounding seed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import pytest
import torch

from leanlm_testing.asserts import assert_verbose_allclose
from leanlm_testing.launches import count_launches

# odd rows/cols, one row, more than 256 columns (several tiles at any BLOCK_M), a 3-D tensor
# (per-tensor fallback) and a vector (PyTorch path)
SHAPES = [(13, 7), (1, 300), (40, 257), (33, 64), (64, 32), (5, 16), (2, 5, 6), (9,)]

MakeOptimizer = Callable[..., Any]


def device() -> torch.device:
    """CUDA if there is one, else the CPU (the Triton interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_multi(
    optimizer: MakeOptimizer,
    backend: str,
    dtypes: Sequence[torch.dtype],
    steps: int,
    *,
    multi: bool = True,
    **kw: Any,
) -> tuple[list[torch.nn.Parameter], Any]:
    """Step `optimizer(params, backend=backend, **kw)` `steps` times; the params and optimizer.

    The parameters have the `SHAPES` (seeded values, `dtypes` cycled); every step gets fresh
    seeded gradient tensors.
    """
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen).to(device(), dtypes[i % len(dtypes)]))
        for i, s in enumerate(SHAPES)
    ]
    opt = optimizer(params, backend=backend, **kw)
    opt.multi_tensor = multi
    opt._sr_seed = 12345  # the same stochastic-rounding noise in every run
    for _ in range(steps):
        for p in params:  # fresh gradient tensors every step (new addresses)
            p.grad = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
        opt.step()
    return params, opt


def assert_fp32_matches(
    ref: Sequence[torch.Tensor], ref_opt: Any, out: Sequence[torch.Tensor], opt: Any, config: str
) -> None:
    """Fp32 parameters and state of a run close to the reference run's.

    Parameters within atol 1e-6, rtol 1e-5; every state tensor but `step` within atol 1e-7,
    rtol 1e-5.
    """
    for p_ref, p_out in zip(ref, out, strict=True):
        name = f"{config} {tuple(p_ref.shape)}"
        assert_verbose_allclose(p_out, p_ref, atol=1e-6, rtol=1e-5, name=name)
        for key, value in ref_opt.state[p_ref].items():
            if key != "step":
                got = opt.state[p_out][key]
                assert_verbose_allclose(got, value, atol=1e-7, rtol=1e-5, name=f"{name} {key}")


def check_fp32_matches_torch_path(
    optimizer: MakeOptimizer, kw: dict[str, Any], config: str, steps: int = 4
) -> tuple[list[torch.nn.Parameter], Any, list[torch.nn.Parameter], Any]:
    """`steps` fused fp32 steps (`backend="triton"`) close to those of the PyTorch path.

    Both are `run_multi` runs with `kw`, compared by `assert_fp32_matches`. Returns the
    reference parameters and optimizer, then the fused ones.
    """
    ref, ref_opt = run_multi(optimizer, "torch", [torch.float32], steps, **kw)
    out, opt = run_multi(optimizer, "triton", [torch.float32], steps, **kw)
    assert_fp32_matches(ref, ref_opt, out, opt, config)
    return ref, ref_opt, out, opt


def check_resume_equals_uninterrupted(optimizer: MakeOptimizer, **kw: Any) -> None:
    """Resumed fused (`backend="triton"`) steps equal uninterrupted ones bit for bit.

    Save after 2 steps, load into a new optimizer (new state tensors, so new tables), step:
    equal to 3 uninterrupted steps (the kernels are deterministic).
    """
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen).to(device()) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen).to(device()) for s in SHAPES] for _ in range(3)]

    def steps(opt: Any, params: list[torch.nn.Parameter], which: range) -> None:
        for k in which:
            for p, g in zip(params, grads[k], strict=True):
                p.grad = g.clone()
            opt.step()

    full = [torch.nn.Parameter(t.clone()) for t in init]
    steps(optimizer(full, backend="triton", **kw), full, range(3))
    part = [torch.nn.Parameter(t.clone()) for t in init]
    opt = optimizer(part, backend="triton", **kw)
    steps(opt, part, range(2))
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in part]
    opt2 = optimizer(resumed, backend="triton", **kw)
    opt2.load_state_dict(opt.state_dict())
    steps(opt2, resumed, range(2, 3))
    for p, q in zip(full, resumed, strict=True):
        assert torch.equal(p, q), tuple(p.shape)


def launch_counts(
    make_opt: Callable[[list[torch.nn.Parameter]], Any],
    modules: Sequence[ModuleType],
    n_mats: int,
) -> list[tuple[int, int]]:
    """(Triton launches, torch ops) of 3 steps over `n_mats` matrices and `n_mats // 3` vectors.

    The matrices have 3 to 7 rows and 16, 32 or 48 columns; `modules` are those whose Triton
    kernels count (see `leanlm_testing.launches.count_launches`). Fresh gradients every step.
    """
    gen = torch.Generator().manual_seed(n_mats)
    shapes: list[tuple[int, ...]] = [(3 + i % 5, 16 * (1 + i % 3)) for i in range(n_mats)]
    shapes += [(5 + i,) for i in range(n_mats // 3)]  # vectors: one more launch
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = make_opt(params)
    result = []
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        with count_launches(modules) as seen:
            opt.step()
        result.append((len(seen.launches), len(seen.ops)))
    return result


def check_launches_do_not_grow(
    make_opt: Callable[[list[torch.nn.Parameter]], Any],
    modules: Sequence[ModuleType],
    *,
    launches: int,
    state_per_matrix: int,
    state_per_vector: int,
) -> None:
    """Launches and torch ops per step do not grow from 3 to 12 matrices (1 to 4 vectors).

    Every step makes `launches` Triton launches with either. The first step's extra torch ops
    are the new state tensors (`state_per_matrix` per matrix, `state_per_vector` per vector);
    later steps only rebuild the two gradient-address tables (the gradients moved): the same
    counts with either, at most 8 torch ops.
    """
    few, many = launch_counts(make_opt, modules, 3), launch_counts(make_opt, modules, 12)
    assert [n for n, _ in few] == [n for n, _ in many] == [launches] * 3, (few, many)
    created = state_per_matrix * (12 - 3) + state_per_vector * (4 - 1)
    assert many[0][1] - few[0][1] == created, (few, many)
    assert few[1:] == many[1:], (few, many)
    assert all(ops <= 8 for _, ops in many[1:]), many


def check_plan_is_what_the_step_launches(
    plan_launches: Callable[..., Sequence[Any]],
    make_opt: Callable[[list[torch.nn.Parameter]], Any],
    shapes: Sequence[tuple[int, ...]],
    modules: Sequence[ModuleType],
    row_passes: Sequence[str],
) -> list[Any]:
    """A launch plan lists the kernels and grids a real step launches, and covers every element.

    `plan_launches(make_opt, shapes, fp32)` (the optimizer package's planner, on meta tensors)
    against the launches of a second real fp32 step recorded by `count_launches(modules)`; each
    kernel of `row_passes` covers every element of the 2-D parameters once. Returns the plan.
    """
    planned = list(plan_launches(make_opt, shapes, torch.float32))
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = make_opt(params)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        with count_launches(modules, execute=False) as seen:
            opt.step()
    ran = [
        (name.rsplit(".", 1)[-1], grid[0])
        for name, grid in zip(seen.launches, seen.grids, strict=True)
    ]
    assert [(lp.kernel, lp.programs) for lp in planned] == ran
    total = sum(s[0] * s[1] for s in shapes if len(s) == 2)
    for kernel in row_passes:
        covered = sum(round(lp.mean_elements * lp.programs) for lp in planned
                      if lp.kernel == kernel)  # fmt: skip
        assert covered == total, (kernel, covered, total)
    return planned


def check_groups_step_as_one_launch_set(
    optimizer: MakeOptimizer,
    kw: dict[str, Any],
    plan_launches: Callable[..., Sequence[Any]],
    group_kernel: str,
    *,
    tables: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch stepped in several groups equals one launch set bit for bit, and the PyTorch path.

    The fused optimizer is `optimizer(params, backend="triton", **kw)`. `tables` is the
    package's work-split module: its scratch budget `MAX_PARTIAL_FLOATS` is shrunk to 800
    floats (each matrix's work items unchanged, the batches split), so that `group_kernel`
    (launched once per group) is at least 3 times in the launch plan (`plan_launches`).
    """
    one, _ = run_multi(optimizer, "triton", [torch.float32], 3, **kw)
    monkeypatch.setattr(tables, "MAX_PARTIAL_FLOATS", 800)

    def make_opt(params: list[torch.nn.Parameter]) -> Any:
        return optimizer(params, backend="triton", **kw)

    planned = [lp.kernel for lp in plan_launches(make_opt, SHAPES, torch.float32)]
    assert planned.count(group_kernel) >= 3, planned
    split, split_opt = run_multi(optimizer, "triton", [torch.float32], 3, **kw)
    ref, ref_opt = run_multi(optimizer, "torch", [torch.float32], 3, **kw)
    assert_fp32_matches(ref, ref_opt, split, split_opt, "groups")
    for a, b in zip(one, split, strict=True):
        assert torch.equal(a, b), tuple(a.shape)  # the same sums in the same order
