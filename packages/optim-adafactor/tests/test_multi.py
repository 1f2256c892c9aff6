"""The multi-tensor fused step (`_multi_kernels.py`): parity, launch counts, table caching.

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
from leanlm_testing import multi_tensor as mt
from leanlm_testing.kernels import fused_kernel_marks
from optim_adafactor import Adafactor, _kernels

pytestmark = fused_kernel_marks(_kernels, mt.device())

_run = partial(mt.run_multi, Adafactor)


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
    ref, ref_opt, out, opt = mt.check_fp32_matches_torch_path(Adafactor, CONFIGS[config], config)
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
    mt.check_resume_equals_uninterrupted(Adafactor, **kw)


@pytest.mark.parametrize("momentum", [False, True])
def test_launches_do_not_grow_with_matrices(momentum: bool) -> None:
    from optim_adafactor import _multi_kernels as _multi
    from optim_adafactor import _multi_vec_kernels as _multi_vec

    # matrices 4 launches, vectors 1, in every step, whatever the number of tensors; the first
    # step creates each tensor's state (matrices: 2 factors, vectors: 1; exp_avg)
    mt.check_launches_do_not_grow(
        lambda params: Adafactor(params, backend="triton", beta1=0.9 if momentum else None),
        [_multi, _multi_vec, _kernels],
        launches=5,
        state_per_matrix=2 + momentum,
        state_per_vector=1 + momentum,
    )


def test_cols_kernel_is_aligned_exactly_for_aligned_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`_mt_cols_kernel` gets ALIGNED=True (its `tl.multiple_of` hints) for the batch whose
    column counts are multiples of 16 and False for the other; tools/gpu_compile.py compiles
    both variants."""
    from optim_adafactor import _multi_kernels as _multi

    real, seen = _multi._mt_cols_kernel, []
    configs = [c for c in _multi.gpu_launch_configs() if c["kernel"] is real]
    assert sorted(c["args"]["ALIGNED"] for c in configs) == [False, True]

    class Recorder:
        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kwargs: Any) -> Any:
                seen.append(kwargs["ALIGNED"])
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(_multi, "_mt_cols_kernel", Recorder())
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((8, 32), (5, 7))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    Adafactor(params, backend="triton").step()
    assert sorted(seen) == [False, True], seen
