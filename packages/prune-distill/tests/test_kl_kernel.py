"""The fused Triton forward-KL kernel (loss and student gradient) against the plain autograd KL.

Interpreter tests (`interpreter`) run small odd shapes on CPU under TRITON_INTERPRET=1 (set by the
test command / nox; they skip without it); the `gpu` test runs a real size on CUDA.

Tolerances. The kernel and the reference compute the same fp32 math from the same upcast inputs,
in a different order (online max/Σexp over vocabulary blocks vs. torch's log_softmax, and
``Σp(b - a) + lse(a) - lse(b)`` vs. ``Σ p (log p - log q)``). Rounding then sits in the
log-sum-exps: a few ulp of ``|lse| <= max|logit|/T + log V``, which becomes a relative error of
that size in every probability and an absolute one in the KL. So both comparisons use
``atol = 16 · eps_fp32 · (max|logit|/T + log V)`` (times T² for the loss, times the largest row
weight · T for the gradient, the bounds of those quantities) with ``rtol = 1e-5``; for unit-scale
logits this is ~1e-5 · scale, against ~1e-7 observed. bf16/fp16 *inputs* change nothing (both
sides upcast the same values), but the gradient is *stored* in bf16, where the interpreter's cast
truncates and torch's rounds to nearest: one bf16 ulp, so ``rtol = 2^-7`` there.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from leanlm_testing import assert_verbose_allclose
from prune_distill import DistillConfig, distill
from prune_distill import _kl_kernels as K
from prune_distill.losses import forward_kl

pytestmark = pytest.mark.skipif(not K.HAS_TRITON, reason="triton is not installed")

EPS = torch.finfo(torch.float32).eps
BF16_ULP = 2.0**-7


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _skip_without_backend() -> None:
    if not K.available(torch.device(_device())):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")


def _inputs(n: int, v: int, dtype: torch.dtype, *, scale: float = 3.0, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(n, v, generator=gen) * scale
    t = torch.randn(n, v, generator=gen) * scale
    mask = torch.rand(n, generator=gen) > 0.3
    mask[0] = True  # at least one counted row
    dev = _device()
    return s.to(dev, dtype).requires_grad_(), t.to(dev, dtype), mask.to(dev)


def _reference(s, t, mask, temperature):
    """Plain autograd forward_kl: loss and d loss / d s."""
    ref = forward_kl(s, t, mask=mask, temperature=temperature, chunk_size=None)
    (grad,) = torch.autograd.grad(ref, s)
    return ref, grad


def _atols(s, t, mask, temperature):
    """(loss atol, grad atol) from the log-sum-exp rounding bound in the module docstring."""
    v = s.shape[-1]
    lse_bound = max(s.detach().abs().max().item(), t.abs().max().item()) / temperature
    lse_bound += math.log(max(v, 1))
    base = 16 * EPS * max(lse_bound, 1.0)
    m = torch.ones(s.shape[:-1]) if mask is None else mask.float()
    w_max = 1.0 / max(m.sum().item(), 1.0)
    return base * temperature**2, base * w_max * temperature


def _check(s, t, mask, temperature, *, grad_rtol=1e-5, loss_scale=1.0):
    ref, g_ref = _reference(s, t, mask, temperature)
    out = forward_kl(s, t, mask=mask, temperature=temperature, backend="triton")
    (g,) = torch.autograd.grad(out * loss_scale, s)
    loss_atol, grad_atol = _atols(s, t, mask, temperature)
    assert out.dtype == torch.float32
    assert g.dtype == s.dtype
    assert torch.isfinite(out)
    assert torch.isfinite(g).all()
    assert_verbose_allclose(out, ref, atol=loss_atol, rtol=1e-5, name="loss")
    assert_verbose_allclose(
        g.float(), loss_scale * g_ref.float(), atol=grad_atol * loss_scale, rtol=grad_rtol,
        name="grad",
    )  # fmt: skip


# rows: tiny / odd / tail-heavy; vocab: 1, odd, two full interpreter blocks (BLOCK_V_MAX = 512)
# and a non-multiple of the block (1003 = 512 + 491)
SHAPES = {"tiny": (1, 1), "odd": (7, 50), "pow2": (4, 1024), "tail": (37, 1003)}


@pytest.mark.interpreter
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp32_matches_plain_reference(shape, temperature, masked) -> None:
    _skip_without_backend()
    s, t, mask = _inputs(*SHAPES[shape], torch.float32)
    _check(s, t, mask if masked else None, temperature)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("shape", "temperature"), [("odd", 1.0), ("tail", 2.5)])
def test_half_inputs_match_plain_reference(shape, temperature, dtype) -> None:
    _skip_without_backend()
    s, t, mask = _inputs(*SHAPES[shape], dtype)
    _check(s, t, mask, temperature, grad_rtol=BF16_ULP)


@pytest.mark.interpreter
def test_mixed_dtypes_strided_rows_and_3d_input() -> None:
    _skip_without_backend()
    # fp32 student rows with a row stride > V (a column slice), bf16 teacher, (B, S, V) + mask
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(2 * 9, 70, generator=gen, device=_device()) * 2
    s = wide[:, :61].detach().requires_grad_()
    assert s.stride(0) == 70
    t = (torch.randn(2 * 9, 61, generator=gen) * 2).to(_device(), torch.bfloat16)
    mask = (torch.rand(2, 9, generator=gen) > 0.4).to(_device())
    ref = forward_kl(s.view(2, 9, 61), t.view(2, 9, 61), mask=mask, chunk_size=None)
    (g_ref,) = torch.autograd.grad(ref, s)
    out = forward_kl(s.view(2, 9, 61), t.view(2, 9, 61), mask=mask, backend="triton")
    (g,) = torch.autograd.grad(out, s)
    loss_atol, grad_atol = _atols(s, t.float(), mask, 1.0)
    assert_verbose_allclose(out, ref, atol=loss_atol, rtol=1e-5, name="loss")
    assert_verbose_allclose(g, g_ref, atol=grad_atol, rtol=1e-5, name="grad")


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["uniform_1e4", "near_equal_1e4", "one_hot_teacher"])
def test_extreme_logits_stay_finite_and_match(case) -> None:
    _skip_without_backend()
    gen = torch.Generator().manual_seed(1)
    n, v = 5, 300
    s = (torch.rand(n, v, generator=gen) * 2 - 1) * 1e4
    if case == "uniform_1e4":
        t = (torch.rand(n, v, generator=gen) * 2 - 1) * 1e4
    elif case == "near_equal_1e4":  # huge logits, small KL: the cancellation case
        t = s + torch.randn(n, v, generator=gen)
    else:  # teacher all mass on one token, student far from it
        t = torch.full((n, v), -1e4)
        t[:, 7] = 1e4
    s = s.to(_device()).requires_grad_()
    _check(s, t.to(_device()), None, 1.0, loss_scale=3.0)


@pytest.mark.interpreter
def test_identical_logits_give_zero_loss_and_gradient() -> None:
    _skip_without_backend()
    s, _, mask = _inputs(9, 77, torch.float32)
    out = forward_kl(s, s.detach(), mask=mask, backend="triton")
    (g,) = torch.autograd.grad(out, s)
    assert abs(out.item()) < 1e-6
    assert g.abs().max().item() < 1e-7


@pytest.mark.interpreter
def test_kernel_rows_match_reference_contract() -> None:
    _skip_without_backend()
    s, t, mask = _inputs(11, 130, torch.float32)
    w = mask.float() / mask.float().sum()
    rows, grad = K.fused_kl(s.detach(), t, w, 1.5, need_grad=True)
    ref_rows, ref_grad = K.fused_kl_reference(s.detach(), t, w, 1.5, need_grad=True)
    assert grad is not None
    assert ref_grad is not None
    loss_atol, grad_atol = _atols(s, t, mask, 1.5)
    assert_verbose_allclose(rows, ref_rows, atol=loss_atol, rtol=1e-5, name="per-row loss")
    assert_verbose_allclose(grad, ref_grad, atol=grad_atol, rtol=1e-5, name="grad")
    assert rows[~mask].abs().max().item() == 0.0  # padding rows: weight 0
    no_grad_rows, none = K.fused_kl(s.detach(), t, w, 1.5, need_grad=False)
    assert none is None
    assert torch.equal(no_grad_rows, rows)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gradient_is_scaled_in_place_and_consumed_once(backend) -> None:
    if backend == "triton":
        _skip_without_backend()
    s, t, _ = _inputs(3, 20, torch.float32)
    _, g_ref = _reference(s, t, None, 1.0)
    out = forward_kl(s, t, backend=backend, chunk_size=2)
    (out * -2.0).backward(retain_graph=True)
    assert s.grad is not None
    torch.testing.assert_close(s.grad, -2.0 * g_ref, atol=1e-7, rtol=1e-5)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        out.backward()


@pytest.mark.interpreter
def test_distill_step_with_triton_backend_equals_torch_backend(make, data) -> None:
    _skip_without_backend()
    teacher = make("llama", initializer_range=0.1, num_hidden_layers=1)
    student_a = copy.deepcopy(teacher)  # one model build: building is the slow part here
    with torch.no_grad():
        for p in student_a.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    student_b = copy.deepcopy(student_a)
    batches = data(1, batch_size=2, seq_len=6)
    kl = {}
    for student, backend in ((student_a, "triton"), (student_b, "torch")):
        # plain SGD (lr 1, no clipping): the parameter change is the gradient itself, so the
        # comparison sees the KL gradient's rounding, not Adam's sign-like first step
        config = DistillConfig(
            kl_backend=backend,
            optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
            max_grad_norm=None,
        )
        kl[backend] = distill(student, teacher, batches, config).kl[0]
    assert kl["triton"] == pytest.approx(kl["torch"], rel=1e-5)
    for (name, a), b in zip(student_a.named_parameters(), student_b.parameters(), strict=True):
        assert_verbose_allclose(a, b, atol=1e-6, rtol=1e-5, name=name)


def test_auto_on_cpu_uses_the_chunked_path(monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("the Triton kernel must not run for CPU tensors with 'auto'")

    monkeypatch.setattr(K, "fused_kl", boom)
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(6, 40, generator=gen).requires_grad_()
    t = torch.randn(6, 40, generator=gen)
    auto = forward_kl(s, t, chunk_size=4)
    assert torch.equal(auto, forward_kl(s, t, chunk_size=4, backend="torch"))


def test_backend_errors(monkeypatch) -> None:
    s = torch.randn(4, 8, requires_grad=True)
    t = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"`backend` \('cuda'\) must be 'auto', 'torch' or"):
        forward_kl(s, t, backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dense teacher logits only"):
        forward_kl(s, torch.topk(t, 3), backend="triton")
    if K.available(s.device):
        with pytest.raises(ValueError, match="`chunk_size` None"):
            forward_kl(s, t, chunk_size=None, backend="triton")
    monkeypatch.setattr(K, "_INTERPRET", False)
    with pytest.raises(ValueError, match=r"backend 'triton' needs .*TRITON_INTERPRET=1.* got cpu"):
        forward_kl(s, t, backend="triton")


@pytest.mark.interpreter
def test_launcher_rejects_bad_inputs() -> None:
    _skip_without_backend()
    dev = _device()
    s, t = torch.randn(4, 8, device=dev), torch.randn(4, 8, device=dev)
    w = torch.ones(4, device=dev)
    with pytest.raises(TypeError, match=r"`teacher` dtype torch\.float64 must be float32"):
        K.fused_kl(s, t.double(), w, 1.0, need_grad=False)
    with pytest.raises(ValueError, match=r"must both be \(N, V\); got \(4, 8\) and \(4, 5\)"):
        K.fused_kl(s, t[:, :5], w, 1.0, need_grad=False)
    with pytest.raises(ValueError, match=r"`weights` must be \(4,\)"):
        K.fused_kl(s, t, w[:3], 1.0, need_grad=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_real_size_matches_reference_and_stays_lean(dtype) -> None:
    n, v = 4096, 32000
    gen = torch.Generator(device="cuda").manual_seed(0)
    s = (torch.randn(n, v, device="cuda", generator=gen) * 3).to(dtype).requires_grad_()
    t = (torch.randn(n, v, device="cuda", generator=gen) * 3).to(dtype)
    mask = torch.rand(n, device="cuda", generator=gen) > 0.1
    ref, g_ref = _reference(s, t, mask, 1.0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = forward_kl(s, t, mask=mask, backend="triton")
    (g,) = torch.autograd.grad(out, s)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    loss_atol, grad_atol = _atols(s, t, mask, 1.0)
    rtol = 1e-5 if dtype == torch.float32 else BF16_ULP
    assert_verbose_allclose(out, ref.detach(), atol=loss_atol, rtol=1e-5, name="loss")
    assert_verbose_allclose(g.float(), g_ref.float(), atol=grad_atol, rtol=rtol, name="grad")
    # the kernel allocates the gradient (N·V in the logits' dtype) and O(N) more, nothing else
    assert extra <= g.numel() * g.element_size() + 8 * 2**20
