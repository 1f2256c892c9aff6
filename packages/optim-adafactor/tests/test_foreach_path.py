"""The multi-tensor PyTorch step of torch semantics (`_foreach_path`) against the per-tensor one.

On the CPU both run the same operations in the same order, so every parameter, state tensor and
reported step size must be equal bit for bit (torch's own parity: test_parity.py).
"""

import pytest
import torch

from leanlm_testing.kernels import no_host_sync
from leanlm_testing.optim import check_tensor_lr_equals_float_lr
from optim_adafactor import Adafactor, _foreach_path

# odd, one row, one column, 3-D and 4-D (factored over the last two dims), a vector, a scalar
SHAPES = [(13, 7), (1, 40), (40, 1), (3, 5, 7), (2, 3, 4, 5), (33,), (), (16, 16)]
COMBOS = {
    "default": {},
    "weight_decay_maximize": {"weight_decay": 0.1, "maximize": True},
    "tensor_lr_d": {"lr": torch.tensor(2e-3), "d": 1.5},
    "eps": {"eps": (1e-20, 1e-2)},
}


def _run(multi: bool, dtype: torch.dtype, kw: dict) -> tuple[list[torch.Tensor], Adafactor]:
    """20 steps over two groups (the second with its own lr), fresh seeded gradients."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    groups = [{"params": params[:5]}, {"params": params[5:], "lr": 3e-3}]
    opt = Adafactor.from_torch_args(groups, **kw)
    opt.multi_tensor = multi
    for _ in range(20):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()
    return params, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("combo", list(COMBOS))
def test_equals_per_tensor_path(combo: str, dtype: torch.dtype, foreach_batches) -> None:
    ours, opt = _run(True, dtype, COMBOS[combo])
    assert foreach_batches == [5, 3] * 20  # one batch per group and step
    ref, ref_opt = _run(False, dtype, COMBOS[combo])
    assert len(foreach_batches) == 40  # multi_tensor=False: the per-tensor path
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b), tuple(a.shape)
        assert opt.state[a].keys() == ref_opt.state[b].keys()
        for key, value in ref_opt.state[b].items():
            got = opt.state[a][key]
            assert torch.equal(got, value) if key != "step" else got == value, (a.shape, key)
    for group, ref_group in zip(opt.param_groups, ref_opt.param_groups, strict=True):
        state, ref_state = opt.state[group["params"][0]], ref_opt.state[ref_group["params"][0]]
        assert opt._get_lr(group, state) == ref_opt._get_lr(ref_group, ref_state)


@pytest.mark.parametrize("multi", [True, False])
def test_float64_tensor_lr_equals_float_lr(multi: bool, foreach_batches) -> None:
    """A float64 lr tensor rounds to fp32 first, as a float lr does (0-dim products would not)."""
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen) for s in SHAPES]

    def make(ps: list[torch.Tensor], lr: float | torch.Tensor) -> Adafactor:
        opt = Adafactor.from_torch_args(ps, lr=lr, weight_decay=0.1)
        opt.multi_tensor = multi
        return opt

    def grads(t: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(100 + t)
        return [torch.randn(s, generator=g) for s in SHAPES]

    check_tensor_lr_equals_float_lr(make, init, grads, steps=6, lr_dtype=torch.float64)
    assert len(foreach_batches) == (12 if multi else 0)  # the foreach path ran (both optimizers)


@pytest.mark.parametrize("foreach", [None, True, False])
def test_foreach_argument_as_torch(foreach: bool | None, foreach_batches) -> None:
    """`from_torch_args(foreach=...)` as `torch.optim.Adafactor`: False steps one at a time."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = Adafactor.from_torch_args([p], foreach=foreach)
    p.grad = torch.ones_like(p)
    opt.step()
    assert foreach_batches == ([] if foreach is False else [1])
    with pytest.raises(TypeError, match="`foreach`"):
        Adafactor.from_torch_args([p], foreach="yes")  # type: ignore[arg-type]


def test_cpu_tensors_take_the_per_tensor_path_by_default(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(_foreach_path, "step", calls.append)
    _run(True, torch.float32, {})
    assert calls == []


def _cuda_pair(shapes, **kw) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Adafactor]]:
    """Two copies of seeded CUDA params under `from_torch_args(**kw)`: batched, per tensor."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in shapes]
    batched = [torch.nn.Parameter(t.cuda()) for t in init]
    per_tensor = [torch.nn.Parameter(t.cuda()) for t in init]
    opts = [Adafactor.from_torch_args(ps, **kw) for ps in (batched, per_tensor)]
    opts[1].multi_tensor = False
    return batched, per_tensor, opts


@pytest.mark.gpu
def test_cuda_batched_step_matches_per_tensor_path() -> None:
    """On CUDA the list ops round as the per-tensor ones up to fp32 reduction order."""
    shapes = [(4096, 1024), (1024, 4096), (8, 1000, 24), (32000, 512), (4096,), (7, 13)]
    batched, per_tensor, opts = _cuda_pair(shapes, lr=5e-3, weight_decay=0.1)
    for _ in range(5):
        for a, b in zip(batched, per_tensor, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        for opt in opts:
            opt.step()
    for a, b in zip(batched, per_tensor, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), tuple(a.shape)


@pytest.mark.gpu
def test_cuda_batched_step_makes_no_host_sync() -> None:
    batched, _, (opt, _) = _cuda_pair([(512, 384), (384,), (3, 64, 32)], weight_decay=0.1)
    for p in batched:
        p.grad = torch.randn_like(p)
    opt.step()
    with no_host_sync():
        opt.step()
