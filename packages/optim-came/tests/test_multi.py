"""The multi-tensor fused CAME step (`_multi.py`): parity, launch counts, resume.

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
from leanlm_testing.launches import count_launches
from leanlm_testing.multi_tensor import (
    assert_fp32_matches,
    check_resume_equals_uninterrupted,
    device,
    run_multi,
)
from optim_came import CAME, _kernels

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not _kernels.HAS_TRITON, reason="triton is not installed"),
]


@pytest.fixture(autouse=True)
def _need_backend() -> None:
    if not _kernels.available(device()):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")


_run = partial(run_multi, CAME)


CONFIGS: dict[str, dict[str, Any]] = {
    "defaults": {"lr": 1e-2},
    "wd_bias_correction": {"lr": 1e-2, "weight_decay": 0.1, "bias_correction": True},
    "tensor_lr_init": {"lr": torch.tensor(3e-3), "instability_init": 1.0, "clip_threshold": 0.5},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fp32_matches_torch_path(config: str) -> None:
    ref, ref_opt = _run("torch", [torch.float32], 4, **CONFIGS[config])
    out, opt = _run("triton", [torch.float32], 4, **CONFIGS[config])
    assert_fp32_matches(ref, ref_opt, out, opt, config)


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
    check_resume_equals_uninterrupted(CAME, **kw)


def test_launches_do_not_grow_with_matrices() -> None:
    from optim_adafactor import _kernels as af_kernels
    from optim_adafactor import _multi as af_multi
    from optim_adafactor import _multi_stats as af_stats
    from optim_came import _multi, _multi_vec

    def counts(n_mats: int) -> list[tuple[int, int]]:
        gen = torch.Generator().manual_seed(n_mats)
        shapes = [(3 + i % 5, 16 * (1 + i % 3)) for i in range(n_mats)]
        shapes += [(5 + i,) for i in range(n_mats // 3)]  # vectors: one more launch
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        opt = CAME(params, lr=1e-3, backend="triton")
        result = []
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            with count_launches(
                [_multi, _multi_vec, af_multi, af_stats, af_kernels, _kernels]
            ) as seen:
                opt.step()
            result.append((len(seen.launches), len(seen.ops)))
        return result

    few, many = counts(3), counts(12)
    assert [n for n, _ in few] == [n for n, _ in many] == [8, 8, 8], (few, many)
    # first step: 5 state tensors per matrix, 2 per vector; then fixed counts (the two
    # gradient-address tables)
    assert many[0][1] - few[0][1] == 5 * (12 - 3) + 2 * (4 - 1), (few, many)
    assert few[1:] == many[1:], (few, many)
    assert all(ops <= 8 for _, ops in many[1:]), many
