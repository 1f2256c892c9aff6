"""Reverse KL and generalized JSD: fused kernels, chunked path and plain autograd reference.

Every path is checked twice: against the plain autograd reference (`chunk_size=None`, the same
math with the gradient by autograd) and against an independent float64 statement built from
``torch.nn.functional.kl_div`` (the mixture ``m = β p + (1-β) q`` written out in probabilities).
Kernel tests run under the Triton interpreter (`interpreter`; they skip without
TRITON_INTERPRET=1) at small odd shapes and at the GPU's shipped 4096-wide vocabulary tile.

Tolerances follow `test_kl_kernel.py`: rounding sits in the fp32 log-sum-exps, a few ulp of
``max|logit|/T + log V``, so ``atol = 16·eps·(max|logit|/T + log V)`` times T² for the loss and
times the largest row weight · T for the gradient, ``rtol = 1e-5``; a gradient stored in bf16 is
one bf16 ulp off (``rtol = 2^-7``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from leanlm_testing import assert_verbose_allclose
from prune_distill import DistillConfig, distill, divergence, forward_kl, jsd, reverse_kl
from prune_distill import _divergence_kernels as D
from prune_distill import _kl_kernels as K

EPS = torch.finfo(torch.float32).eps
BF16_ULP = 2.0**-7
CASES = {"reverse_kl": ("reverse_kl", 1.0), "jsd_0.3": ("jsd", 0.3), "jsd_0.9": ("jsd", 0.9)}


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _skip_without_backend() -> None:
    if not K.available(torch.device(_device())):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")


def _inputs(n: int, v: int, dtype: torch.dtype = torch.float32, *, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(n, v, generator=gen) * 3
    t = torch.randn(n, v, generator=gen) * 3
    mask = torch.rand(n, generator=gen) > 0.3
    mask[0] = True
    dev = _device()
    return s.to(dev, dtype).requires_grad_(), t.to(dev, dtype), mask.to(dev)


def _float64(kind, s, teacher_logp, mask, temperature, beta):
    """Independent float64 statement: loss and d loss / d s, from `F.kl_div` on probabilities."""
    s64 = s.detach().double().requires_grad_()
    log_q = F.log_softmax(s64 / temperature, dim=-1)
    log_p = teacher_logp.double()
    # F.kl_div(input=log a, target=log b, log_target=True) = Σ b (log b - log a) for the
    # student's (finite) log-probabilities; the teacher's enter as probabilities (xlogy: 0 log 0
    # = 0 outside a top-k), which carry no gradient
    kl_q = lambda log_a: F.kl_div(log_a, log_q, reduction="none", log_target=True).sum(-1)  # noqa: E731
    if kind == "reverse_kl":
        rows = kl_q(log_p)  # KL(q || p)
    else:  # log m in log space: probabilities of ±1e4 logits underflow even in float64
        log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1 - beta))
        kl_pm = F.kl_div(log_m, log_p.exp(), reduction="none").sum(-1)
        rows = beta * kl_pm + (1 - beta) * kl_q(log_m)
    w = mask.double() / mask.double().sum()
    loss = (rows * w).sum() * temperature**2
    (grad,) = torch.autograd.grad(loss, s64)
    return loss, grad


def _tols(s, t, mask, temperature):
    lse = max(s.detach().abs().max().item(), t.abs().max().item()) / temperature
    base = 16 * EPS * max(lse + math.log(s.shape[-1]), 1.0)
    return base * temperature**2, base * temperature / mask.float().sum().item()


def _check_all(kind, beta, s, t, mask, temperature, backend, *, grad_rtol=1e-5):
    """`backend`'s loss and gradient vs the plain reference and the float64 formula."""
    kw = {"loss": kind, "beta": beta, "mask": mask, "temperature": temperature}
    out = divergence(s, t, **kw, backend=backend, chunk_size=5)
    (g,) = torch.autograd.grad(out * 2.0, s)  # the saved gradient is scaled by grad_out
    ref = divergence(s, t, **kw, chunk_size=None)
    (g_ref,) = torch.autograd.grad(ref, s)
    log_p = F.log_softmax(t.double() / temperature, dim=-1)
    ref64, g64 = _float64(kind, s, log_p, mask, temperature, beta)
    loss_atol, grad_atol = _tols(s, t, mask, temperature)
    assert out.dtype == torch.float32
    assert g.dtype == s.dtype
    assert torch.isfinite(g).all()
    assert_verbose_allclose(out, ref, atol=loss_atol, rtol=1e-5, name="loss vs reference")
    assert_verbose_allclose(out.double(), ref64, atol=loss_atol, rtol=1e-5, name="loss vs f64")
    assert_verbose_allclose(
        g.float(), 2.0 * g_ref.float(), atol=2 * grad_atol, rtol=grad_rtol, name="grad vs ref"
    )
    assert_verbose_allclose(
        g.double(), 2.0 * g64, atol=2 * grad_atol, rtol=grad_rtol, name="grad vs f64"
    )


# rows x vocab: tiny, odd (1007 = 512 + 495: two interpreter blocks, a ragged tail), a power of two
SHAPES = {"tiny": (1, 1), "odd": (13, 1007), "pow2": (4, 1024)}


@pytest.mark.interpreter
@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_fp32_matches_reference_and_float64(case, shape, temperature) -> None:
    _skip_without_backend()
    s, t, mask = _inputs(*SHAPES[shape])
    _check_all(*CASES[case], s, t, mask, temperature, "triton")


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["reverse_kl", "jsd_0.3"])
def test_kernel_bf16_inputs(case) -> None:
    _skip_without_backend()
    s, t, mask = _inputs(13, 1007, torch.bfloat16, seed=1)
    _check_all(*CASES[case], s, t, mask, 2.5, "triton", grad_rtol=BF16_ULP)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["reverse_kl", "jsd_0.3"])
def test_kernel_at_the_shipped_gpu_tile(case, monkeypatch) -> None:
    """The 4096-wide block a GPU uses, over 4096 + 7 words: one full block and a 7-word tail."""
    _skip_without_backend()
    monkeypatch.setattr(K, "BLOCK_V_MAX", 4096)
    assert K.block_and_warps(4096 + 7) == (4096, 8)
    s, t, mask = _inputs(3, 4096 + 7, seed=2)
    _check_all(*CASES[case], s, t, mask, 1.0, "triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_matches_reference_and_float64(case, dtype) -> None:
    s, t, mask = _inputs(13, 1007, dtype, seed=3)
    _check_all(
        *CASES[case],
        s,
        t,
        mask,
        2.0,
        "torch",
        grad_rtol=1e-5 if dtype == torch.float32 else BF16_ULP,
    )


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["reverse_kl", "jsd_0.3"])
def test_kernel_rows_match_reference_contract(case) -> None:
    _skip_without_backend()
    kind, beta = CASES[case]
    s, t, mask = _inputs(11, 130)
    w = mask.float() / mask.float().sum()
    rows, grad = D.fused_divergence(kind, s.detach(), t, w, 1.5, beta=beta, need_grad=True)
    ref_rows, ref_grad = D.fused_divergence_reference(
        kind, s.detach(), t, w, 1.5, beta=beta, need_grad=True
    )
    loss_atol, grad_atol = _tols(s, t, mask, 1.5)
    assert_verbose_allclose(rows, ref_rows, atol=loss_atol, rtol=1e-5, name="per-row loss")
    assert_verbose_allclose(grad, ref_grad, atol=grad_atol, rtol=1e-5, name="grad")
    assert rows[~mask].abs().max().item() == 0.0  # padding rows: weight 0
    again, none = D.fused_divergence(kind, s.detach(), t, w, 1.5, beta=beta, need_grad=False)
    assert none is None
    assert torch.equal(again, rows)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["reverse_kl", "jsd_0.3"])
@pytest.mark.parametrize("logits", ["uniform_1e4", "one_hot_teacher"])
def test_kernel_extreme_logits_stay_finite_and_match(case, logits) -> None:
    _skip_without_backend()
    gen = torch.Generator().manual_seed(4)
    s = (torch.rand(5, 300, generator=gen) * 2 - 1) * 1e4
    if logits == "uniform_1e4":
        t = (torch.rand(5, 300, generator=gen) * 2 - 1) * 1e4
    else:  # all teacher mass on one word, the student far from it
        t = torch.full((5, 300), -1e4)
        t[:, 7] = 1e4
    s = s.to(_device()).requires_grad_()
    _check_all(*CASES[case], s, t.to(_device()), torch.ones(5, dtype=torch.bool), 1.0, "triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_identical_logits_give_zero_and_jsd_is_bounded(backend) -> None:
    if backend == "triton":
        _skip_without_backend()
    s, t, mask = _inputs(9, 77)
    for loss in ("reverse_kl", "jsd"):
        out = divergence(s, s.detach(), loss=loss, mask=mask, backend=backend)
        (g,) = torch.autograd.grad(out, s)
        assert abs(out.item()) < 1e-6
        assert g.abs().max().item() < 1e-7
    far = divergence(s * 100, t * 100, loss="jsd", beta=0.5, mask=mask, backend=backend)
    assert 0.5 * math.log(2) < far.item() <= math.log(2) + 1e-6  # symmetric JSD <= log 2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_beta_endpoints_are_forward_and_reverse_kl(backend) -> None:
    if backend == "triton":
        _skip_without_backend()
    s, t, mask = _inputs(6, 50)
    kw = {"mask": mask, "temperature": 1.5, "backend": backend}
    fwd, rev = forward_kl(s, t, **kw), reverse_kl(s, t, **kw)
    assert not torch.isclose(fwd, rev)  # the endpoints differ, so the check below means something
    assert torch.equal(jsd(s, t, beta=0.0, **kw), fwd)
    assert torch.equal(jsd(s, t, beta=1.0, **kw), rev)
    log_p = F.log_softmax(t.double() / 1.5, dim=-1)
    rev64, _ = _float64("reverse_kl", s, log_p, mask, 1.5, 1.0)
    assert_verbose_allclose(rev.double(), rev64, atol=1e-5, rtol=1e-5, name="reverse KL")
    # close to the endpoints the mixture formula goes to 0, which is why they are defined apart
    assert jsd(s, t, beta=1e-4, **kw).item() < 1e-2 * fwd.item()


@pytest.mark.parametrize("k", [5, 50])
def test_jsd_on_a_top_k_teacher(k) -> None:
    """The teacher renormalised over its k words, no mass elsewhere; k = V is the dense loss."""
    s, t, mask = _inputs(7, 50, seed=5)
    top = torch.topk(t, k)
    out = jsd(s, top, beta=0.4, mask=mask, temperature=2.0, chunk_size=3)
    (g,) = torch.autograd.grad(out, s)
    ref = jsd(s, top, beta=0.4, mask=mask, temperature=2.0, chunk_size=None)
    (g_ref,) = torch.autograd.grad(ref, s)
    kept = torch.full_like(t, float("-inf")).scatter(-1, top.indices, top.values)
    log_p = F.log_softmax(kept.double() / 2.0, dim=-1)
    ref64, g64 = _float64("jsd", s, log_p, mask, 2.0, 0.4)
    assert torch.isfinite(out)
    assert_verbose_allclose(out, ref, atol=1e-6, rtol=1e-5, name="loss vs reference")
    assert_verbose_allclose(out.double(), ref64, atol=1e-6, rtol=1e-5, name="loss vs f64")
    assert_verbose_allclose(g, g_ref, atol=1e-7, rtol=1e-5, name="grad vs reference")
    assert_verbose_allclose(g.double(), g64, atol=1e-7, rtol=1e-5, name="grad vs f64")
    if k == t.shape[-1]:
        dense = jsd(s, t, beta=0.4, mask=mask, temperature=2.0)
        assert_verbose_allclose(out, dense, atol=1e-6, rtol=1e-5, name="k = V vs dense")


def test_bad_loss_and_beta_name_the_argument() -> None:
    s, t, _ = _inputs(3, 10)
    with pytest.raises(ValueError, match=r"`loss` \('kl'\) must be one of 'forward_kl', 'rev"):
        divergence(s, t, loss="kl")  # type: ignore[arg-type]
    for beta in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=rf"`beta` \({beta}\) must be a number in \[0, 1\]"):
            jsd(s, t, beta=beta)
        with pytest.raises(ValueError, match=r"`beta` .* must be a number in \[0, 1\]"):
            DistillConfig(loss="jsd", beta=beta)
    with pytest.raises(ValueError, match=r"`loss` \('reverse_kl'\) needs the teacher's full"):
        reverse_kl(s, torch.topk(t, 3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`loss` \('jsd'\) at `beta` 1 needs the teacher's"):
        jsd(s, torch.topk(t, 3), beta=1.0)
    with pytest.raises(ValueError, match=r"`loss` \('reverse_kl'\) needs"):
        DistillConfig(loss="reverse_kl", top_k=20)
    with pytest.raises(ValueError, match="dense teacher logits only"):
        jsd(s, torch.topk(t, 3), backend="triton")
    with pytest.raises(ValueError, match=r"`temperature` \(0\) must be > 0"):
        reverse_kl(s, t, temperature=0)
    with pytest.raises(ValueError, match=r"`kind` \('kl'\) must be one of"):
        D.fused_divergence("kl", s, t, torch.ones(3), 1.0, need_grad=False)
    with pytest.raises(ValueError, match=r"`beta` \(0.0\) must be strictly between 0 and 1"):
        D.fused_divergence("jsd", s, t, torch.ones(3), 1.0, beta=0.0, need_grad=False)


@pytest.mark.parametrize("loss", ["reverse_kl", "jsd"])
def test_distill_logs_the_configured_loss(loss, make, data) -> None:
    """`distill`'s logged term is the chosen divergence of the student's first-step logits."""
    teacher = make("llama", initializer_range=0.1, num_hidden_layers=1)
    student = make("llama", initializer_range=0.1, num_hidden_layers=1, seed=1)
    batches = data(1, batch_size=2, seq_len=6)
    b = batches[0]
    with torch.no_grad():
        expected = divergence(
            student(input_ids=b["input_ids"]).logits,
            teacher(input_ids=b["input_ids"]).logits,
            loss=loss, beta=0.7, mask=b.get("attention_mask"),
        )  # fmt: skip
    config = DistillConfig(loss=loss, beta=0.7, kl_backend="torch")
    got = distill(student, teacher, batches, config).kl[0]
    assert got == pytest.approx(expected.item(), rel=1e-5)
