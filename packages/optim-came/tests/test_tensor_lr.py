"""A tensor `lr` (e.g. for `torch.compile`-friendly schedules) gives the float `lr` result."""

import pytest
import torch

from leanlm_testing.optim import check_tensor_lr_equals_float_lr
from optim_came import CAME, _kernels

SHAPES = [(9, 7), (7,), (2, 3, 5), (17, 20)]


def _params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


BACKENDS = ["torch"]
if _kernels.available(torch.device("cpu")):  # the kernels under the Triton interpreter
    BACKENDS.append(pytest.param("triton", marks=pytest.mark.interpreter))


@pytest.mark.parametrize("lr_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_tensor_lr_equals_float_lr(weight_decay: float, backend: str, lr_dtype) -> None:
    """`lr=torch.tensor(1e-3)` equals `lr=1e-3` bit for bit, also when a scheduler changes it."""
    kw = {"weight_decay": weight_decay, "backend": backend}
    check_tensor_lr_equals_float_lr(
        lambda ps, lr: CAME(ps, lr=lr, **kw), _params(), _grads, steps=6, lr_dtype=lr_dtype
    )


@pytest.mark.parametrize(
    "lr", [torch.tensor([1e-3, 2e-3]), torch.tensor(1, dtype=torch.int64), torch.tensor(-1e-3)]
)
def test_bad_tensor_lr_is_rejected_by_name(lr: torch.Tensor) -> None:
    with pytest.raises((TypeError, ValueError), match="`lr`"):
        CAME([torch.zeros(3, 3, requires_grad=True)], lr=lr)
