"""The chunked KL (loss and student gradient) against the plain autograd reference."""

from __future__ import annotations

import pytest
import torch

from prune_distill.losses import forward_kl


def _inputs(n: int, v: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    s = (torch.randn(n, v, generator=gen) * 3).to(dtype).requires_grad_()
    t = (torch.randn(n, v, generator=gen) * 3).to(dtype)
    mask = (torch.rand(n, generator=gen) > 0.3).long()
    return s, t, mask


@pytest.mark.parametrize(("n", "v"), [(1, 7), (13, 64), (64, 33), (100, 256)])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("top_k", [None, 5])
def test_chunked_matches_reference(n, v, temperature, top_k):
    s, t, mask = _inputs(n, v, torch.float32)
    teacher = t if top_k is None else torch.topk(t, min(top_k, v))
    ref = forward_kl(s, teacher, mask=mask, temperature=temperature, chunk_size=None)
    (g_ref,) = torch.autograd.grad(ref, s)
    out = forward_kl(s, teacher, mask=mask, temperature=temperature, chunk_size=7)
    (g,) = torch.autograd.grad(out * 3.0, s)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g, 3.0 * g_ref, rtol=1e-5, atol=1e-7)


def test_bf16_logits_fp32_math():
    s, t, mask = _inputs(40, 96, torch.bfloat16)
    ref = forward_kl(s.float(), t.float(), mask=mask, chunk_size=None)
    out = forward_kl(s, t, mask=mask, chunk_size=16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    (g,) = torch.autograd.grad(out, s)
    assert g.dtype == torch.bfloat16


def test_topk_with_full_vocab_equals_dense():
    s, t, _ = _inputs(20, 50, torch.float32)
    dense = forward_kl(s, t)
    topk = forward_kl(s, torch.topk(t, 50))
    torch.testing.assert_close(topk, dense, rtol=1e-5, atol=1e-6)


def test_identical_distributions_give_zero_and_kl_is_nonnegative():
    s, t, _ = _inputs(30, 40, torch.float32)
    s = s.detach()
    assert float(forward_kl(s, s)) == pytest.approx(0.0, abs=1e-6)
    assert float(forward_kl(s, t)) > 0


def test_errors():
    s, t, _ = _inputs(4, 8, torch.float32)
    with pytest.raises(ValueError, match="`temperature`"):
        forward_kl(s, t, temperature=0)
    with pytest.raises(ValueError, match=r"teacher vocab \(9\) != student vocab \(8\)"):
        forward_kl(s, torch.zeros(4, 9))
    with pytest.raises(ValueError, match="`chunk_size`"):
        forward_kl(s, t, chunk_size=0)


def test_direction_is_forward_kl_teacher_to_student():
    """A bimodal teacher and a unimodal student: KL(t || s) and KL(s || t) differ by far, and so
    do their gradients. The loss and gradient must be the forward ones, on every path."""
    t = torch.log(torch.tensor([[0.45, 0.45, 0.05, 0.05]]))
    s0 = torch.log(torch.tensor([[0.85, 0.05, 0.05, 0.05]]))
    p_t, p_s = t.softmax(-1), s0.softmax(-1)
    fwd = float((p_t * (p_t.log() - p_s.log())).sum())
    rev = float((p_s * (p_s.log() - p_t.log())).sum())
    assert abs(fwd - rev) > 0.1  # the case tells the directions apart
    grad_fwd = p_s - p_t  # d KL(t || s) / d s
    from prune_distill import _kl_kernels

    paths = [(None, "torch"), (1, "torch")] + [(1, "triton")] * _kl_kernels.HAS_TRITON
    for chunk, backend in paths:
        s = s0.clone().requires_grad_()
        loss = forward_kl(s, t, chunk_size=chunk, backend=backend)
        (g,) = torch.autograd.grad(loss, s)
        assert float(loss.detach()) == pytest.approx(fwd, rel=1e-5)
        torch.testing.assert_close(g, grad_fwd, rtol=1e-5, atol=1e-7)
