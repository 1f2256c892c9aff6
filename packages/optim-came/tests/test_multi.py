"""The multi-tensor fused CAME step (`_multi_kernels.py`): parity, launch counts, resume.

Interpreter tests on CPU (TRITON_INTERPRET=1). fp32: against the PyTorch path after several
steps (rtol 1e-5: sums in another order). bf16 parameters and a bf16 `exp_avg`: against the
per-tensor kernels (same per-element arithmetic and stochastic-rounding seeds: over 99% equal
bit for bit, the rest within one bf16 ulp). The launch test checks that neither Triton
launches nor torch ops per step grow with the number of matrices.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch

from leanlm_testing import assert_verbose_allclose
from leanlm_testing import multi_tensor as mt
from leanlm_testing.kernels import fused_kernel_marks
from optim_came import CAME, _kernels

pytestmark = fused_kernel_marks(_kernels, mt.device())

_run = partial(mt.run_multi, CAME)


CONFIGS: dict[str, dict[str, Any]] = {
    "defaults": {"lr": 1e-2},
    "wd_bias_correction": {"lr": 1e-2, "weight_decay": 0.1, "bias_correction": True},
    "tensor_lr_init": {"lr": torch.tensor(3e-3), "instability_init": 1.0, "clip_threshold": 0.5},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fp32_matches_torch_path(config: str) -> None:
    mt.check_fp32_matches_torch_path(CAME, CONFIGS[config], config)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_bf16_matches_per_tensor_kernels(state_dtype: torch.dtype) -> None:
    kw = {"lr": 1e-2, "weight_decay": 0.1, "stochastic_rounding": True, "state_dtype": state_dtype}
    dtypes = [torch.bfloat16, torch.float32]  # two batches
    old, old_opt = _run("triton", dtypes, 3, multi=False, **kw)
    new, new_opt = _run("triton", dtypes, 3, multi=True, **kw)
    for p_old, p_new in zip(old, new, strict=True):
        for a, b in ((p_old, p_new), (old_opt.state[p_old]["exp_avg"],
                                      new_opt.state[p_new]["exp_avg"])):  # fmt: skip
            if a.dtype == torch.bfloat16:
                ulps = 1
                if a.numel() >= 100:
                    assert (a == b).float().mean() > 0.99, tuple(a.shape)
                else:  # vectors: the kernel rounds a bf16 m once per step, torch twice
                    ulps = 2
                assert_verbose_allclose(b, a, atol=1e-30, rtol=ulps * 2**-7, name="bf16 ulps")
            elif state_dtype == torch.bfloat16:  # fp32 p stepped by lr·m, m a bf16 ulp apart:
                # |Δp| <= lr · 2^-7 · |m| per step, |m| < 1 here
                assert_verbose_allclose(b, a, atol=1e-2 * 2**-7, rtol=1e-5, name="fp32, bf16 m")
            else:
                assert_verbose_allclose(b, a, atol=1e-7, rtol=1e-5, name="fp32")


def test_resume_equals_uninterrupted() -> None:
    """Save after 2 steps, load into a new optimizer (new tables), step: bit for bit equal."""
    kw: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.01}
    mt.check_resume_equals_uninterrupted(CAME, **kw)


def test_launches_do_not_grow_with_matrices() -> None:
    from optim_adafactor import _kernels as af_kernels
    from optim_adafactor import _multi_kernels as af_multi
    from optim_adafactor import _multi_stats_kernels as af_stats
    from optim_came import _multi_kernels as _multi
    from optim_came import _multi_vec_kernels as _multi_vec

    # first step: 5 state tensors per matrix, 2 per vector
    mt.check_launches_do_not_grow(
        lambda params: CAME(params, lr=1e-3, backend="triton"),
        [_multi, _multi_vec, af_multi, af_stats, af_kernels, _kernels],
        launches=8,
        state_per_matrix=5,
        state_per_vector=2,
    )
