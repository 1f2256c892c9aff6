"""The multi-tensor fused step (`_multi.py`): parity, launch counts, table caching.

Interpreter tests on CPU (TRITON_INTERPRET=1). The batched kernels are compared against the
PyTorch path (fp32: rtol 1e-5 after several steps; sums run in another order) and, for bf16
parameters, against the per-tensor kernels: the same arithmetic per element and the same
stochastic-rounding seeds, so over 99% of the elements are equal bit for bit and the rest one
bf16 ulp apart (a scale from sums in another order can flip a rounding). The launch test
counts Triton launches and torch ops per step and checks that neither grows with the number
of matrices.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch

from leanlm_testing import assert_verbose_allclose
from leanlm_testing.launches import count_launches
from leanlm_testing.multi_tensor import (
    assert_fp32_matches,
    check_resume_equals_uninterrupted,
    device,
    run_multi,
)
from optim_adafactor import Adafactor, _kernels

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not _kernels.HAS_TRITON, reason="triton is not installed"),
]


@pytest.fixture(autouse=True)
def _need_backend() -> None:
    if not _kernels.available(device()):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")


_run = partial(run_multi, Adafactor)


_NO_SCALE = {"lr": 1e-2, "relative_step": False, "scale_parameter": False}
CONFIGS = {
    "defaults": {},
    "momentum_wd": {"beta1": 0.9, "weight_decay": 0.1, **_NO_SCALE},
    "momentum_scale_wd": {"beta1": 0.8, "weight_decay": 0.05},
    "no_clip_maximize": {"clip_threshold": None, "maximize": True},
    "tensor_lr": {"lr": torch.tensor(3e-3), "relative_step": False, "beta1": 0.9},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fp32_matches_torch_path(config: str) -> None:
    steps = 4
    ref, ref_opt = _run("torch", [torch.float32], steps, **CONFIGS[config])
    out, opt = _run("triton", [torch.float32], steps, **CONFIGS[config])
    assert_fp32_matches(ref, ref_opt, out, opt, config)
    group, state = opt.param_groups[0], opt.state[out[0]]
    assert opt._get_lr(group, state) == pytest.approx(
        ref_opt._get_lr(ref_opt.param_groups[0], ref_opt.state[ref[0]]), rel=1e-5
    )


@pytest.mark.parametrize("stochastic_rounding", [False, True])
def test_mixed_dtypes_equal_per_tensor_kernels(stochastic_rounding: bool) -> None:
    """bf16 and fp32 matrices in one group (two batches) match the per-tensor kernels."""
    kw = {"beta1": 0.9, "weight_decay": 0.1, "stochastic_rounding": stochastic_rounding}
    dtypes = [torch.bfloat16, torch.float32]
    old, old_opt = _run("triton", dtypes, 3, multi=False, **kw)
    new, new_opt = _run("triton", dtypes, 3, multi=True, **kw)
    for p_old, p_new in zip(old, new, strict=True):
        if p_old.dtype == torch.bfloat16:  # Σu² sums in another order: rare 1-ulp flips
            assert (p_old == p_new).float().mean() > 0.99, tuple(p_old.shape)
            assert_verbose_allclose(p_new, p_old, atol=0, rtol=2**-7, name="bf16 ulp")
        else:
            assert_verbose_allclose(p_new, p_old, atol=1e-6, rtol=1e-5, name="fp32")
        m_old, m_new = old_opt.state[p_old]["exp_avg"], new_opt.state[p_new]["exp_avg"]
        assert_verbose_allclose(m_new, m_old, atol=1e-7, rtol=1e-5, name="exp_avg")
    ref, _ = _run("torch", dtypes, 3, **kw)  # and close to the PyTorch path (bf16: a few ulp)
    for p_ref, p_new in zip(ref, new, strict=True):
        tol = 2e-2 if p_ref.dtype == torch.bfloat16 else 1e-5
        assert_verbose_allclose(p_new.float(), p_ref.float(), atol=tol, rtol=tol, name="torch")


def test_resume_equals_uninterrupted() -> None:
    """Save after 2 steps, load into a new optimizer (new state tensors, so new tables), step:
    equal bit for bit to 3 uninterrupted steps (the kernels are deterministic)."""
    kw: dict[str, Any] = {"beta1": 0.9, "weight_decay": 0.01}
    check_resume_equals_uninterrupted(Adafactor, **kw)


@pytest.mark.parametrize("momentum", [False, True])
def test_launches_do_not_grow_with_matrices(momentum: bool) -> None:
    from optim_adafactor import _multi, _multi_vec

    def counts(n_mats: int) -> list[tuple[int, int]]:
        gen = torch.Generator().manual_seed(n_mats)
        shapes = [(3 + i % 5, 16 * (1 + i % 3)) for i in range(n_mats)]
        shapes += [(5 + i,) for i in range(n_mats // 3)]  # vectors: one more launch
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        opt = Adafactor(params, backend="triton", beta1=0.9 if momentum else None)
        result = []
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            with count_launches([_multi, _multi_vec, _kernels]) as seen:
                opt.step()
            result.append((len(seen.launches), len(seen.ops)))
        return result

    few, many = counts(3), counts(12)
    # matrices 4 launches, vectors 1, in every step, whatever the number of tensors
    assert [launches for launches, _ in few] == [launches for launches, _ in many] == [5, 5, 5]
    # the first step creates each tensor's state (matrices: 2 factors, vectors: 1; exp_avg)
    # and builds the tables; later steps only rebuild the two gradient-address tables (the
    # gradients moved): fixed counts
    created = (2 + momentum) * (12 - 3) + (1 + momentum) * (4 - 1)
    assert many[0][1] - few[0][1] == created, (few, many)
    assert few[1:] == many[1:], (few, many)
    assert all(ops <= 8 for _, ops in many[1:]), many
