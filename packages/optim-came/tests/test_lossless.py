"""Lossless state (bit-exact load and resume for bf16/fp16/fp64 params, SR randomness in the
checkpoint) and weight decay judged against a float64 run of came-pytorch."""

import pytest
import torch

came_pytorch = pytest.importorskip("came_pytorch")

from leanlm_testing.optim import check_against_float64_reference, check_lossless_resume  # noqa: E402
from optim_came import CAME  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("sr", [False, True])
def test_resume_is_bit_exact(dtype, sr) -> None:
    kw = {"lr": 1e-2, "weight_decay": 0.01, "stochastic_rounding": sr}
    check_lossless_resume(lambda ps: CAME(ps, **kw), dtype)


@pytest.mark.parametrize("shape", [(13, 7), (33,)])
@pytest.mark.parametrize(
    "kw", [{"lr": 1e-3, "weight_decay": 1e-2}, {"lr": 1e-4, "weight_decay": 0.1}]
)
def test_weight_decay_error_within_2x_of_came_pytorch_against_float64(kw, shape) -> None:
    check_against_float64_reference(CAME, came_pytorch.CAME, shape, kw, str(kw))
