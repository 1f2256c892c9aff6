"""Checks of an optimizer's multi-tensor fused step against its PyTorch path and itself.

The optimizer packages pass their optimizer class; it takes `backend=` ("torch" or "triton"),
has a `multi_tensor` switch and a `_sr_seed` (the stochastic-rounding seed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from leanlm_testing.asserts import assert_verbose_allclose

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
