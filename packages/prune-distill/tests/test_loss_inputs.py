"""The losses on inputs the other tests avoid: ``-inf`` logits, masks of the wrong size, and a
teacher that requires grad, on every path (plain autograd, chunked PyTorch, Triton kernels).

``-inf`` logits give a token probability 0, which adds ``0 · log 0 = 0`` (xlogy semantics). The
float64 reference drops the vocabulary ids where student and teacher are both ``-inf`` (both have
no mass there: the divergence and the gradient of the rest do not change, and the student's
gradient there is 0) and states each divergence with ``F.kl_div`` on the others, whose target
enters through xlogy (a teacher id of probability 0 adds 0). Tolerances as in
`test_divergences.py` (log-sum-exp rounding of the finite logits).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from leanlm_testing import assert_verbose_allclose
from prune_distill import _kl_kernels as K
from prune_distill import divergence
from prune_distill.losses import resolve_path

EPS = torch.finfo(torch.float32).eps
NEG_INF = float("-inf")
V = 1007  # two 512-wide interpreter blocks and a ragged tail
DEAD = [*range(520), 700, V - 1]  # the whole first block: the online max starts at -inf
LOSSES = {
    "forward_kl": ("forward_kl", 0.5),
    "reverse_kl": ("reverse_kl", 0.5),
    "jsd_0.3": ("jsd", 0.3),
    "jsd_0.5": ("jsd", 0.5),
    "jsd_0.9": ("jsd", 0.9),
}
PATHS = {"plain": (None, "torch"), "chunked": (4, "torch"), "triton": (4, "triton")}
# the interpreter runs kernels in numpy, which warns when evaluating the branch `tl.where` drops
NUMPY_NAN_WARNINGS = "ignore:(invalid value|divide by zero) encountered:RuntimeWarning"


def _skip_without_triton(backend: str) -> None:
    if backend == "triton" and not K.available(torch.device("cpu")):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")


def _inputs(where: str, *, n: int = 6, seed: int = 0):
    """Student and teacher (n, V) logits, ``-inf`` at `DEAD` in the teacher (and the student if
    `where` is "both"), and a row mask."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(n, V, generator=gen) * 3
    t = torch.randn(n, V, generator=gen) * 3
    t[:, DEAD] = NEG_INF
    if where == "both":
        s[:, DEAD] = NEG_INF
    mask = torch.rand(n, generator=gen) > 0.3
    mask[0] = True
    return s.requires_grad_(), t, mask


def _float64(kind, s, log_p, mask, temperature, beta):
    """Loss and d loss / d s in float64; `log_p` (n, V) are the teacher's log-probabilities."""
    live = ~(s.detach().isneginf() & log_p.isneginf()).all(0)
    s64 = s.detach().double()[:, live].requires_grad_()
    log_q = F.log_softmax(s64 / temperature, dim=-1)
    p = F.softmax(log_p.double()[:, live], dim=-1)  # renormalised over the live ids
    if kind == "forward_kl":
        rows = F.kl_div(log_q, p, reduction="none").sum(-1)
    elif kind == "reverse_kl":
        rows = F.kl_div(p.log(), log_q, reduction="none", log_target=True).sum(-1)
    else:
        log_m = (beta * p + (1 - beta) * log_q.exp()).log()
        kl_pm = F.kl_div(log_m, p, reduction="none").sum(-1)
        kl_qm = F.kl_div(log_m, log_q, reduction="none", log_target=True).sum(-1)
        rows = beta * kl_pm + (1 - beta) * kl_qm
    w = mask.double() / mask.double().sum()
    loss = (rows * w).sum() * temperature**2
    (g,) = torch.autograd.grad(loss, s64)
    grad = torch.zeros(s.shape, dtype=torch.float64)
    grad[:, live] = g
    return loss, grad


def _tols(s, t, mask, temperature):
    finite = torch.cat([s.detach().flatten(), t.flatten()]).isfinite()
    big = torch.cat([s.detach().flatten(), t.flatten()])[finite].abs().max().item()
    base = 16 * EPS * (big / temperature + math.log(V))
    return base * temperature**2, base * temperature / mask.float().sum().item()


def _check(out, g, ref, g_ref, s, t, mask, temperature, name):
    loss_atol, grad_atol = _tols(s, t, mask, temperature)
    assert torch.isfinite(out), name
    assert torch.isfinite(g).all(), name
    assert_verbose_allclose(out.double(), ref, atol=loss_atol, rtol=1e-5, name=f"{name} loss")
    assert_verbose_allclose(g.double(), g_ref, atol=grad_atol, rtol=1e-5, name=f"{name} grad")


CASES = [("teacher", k) for k in LOSSES if k != "reverse_kl"] + [("both", k) for k in LOSSES]


@pytest.mark.interpreter
@pytest.mark.filterwarnings(NUMPY_NAN_WARNINGS)
@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("where", "case"), CASES)
def test_neg_inf_logits_give_the_xlogy_value_and_gradient(where, case, path, temperature):
    """Teacher ``-inf`` (and student ``-inf`` at the same ids): finite, equal to float64, and
    every path equal to the plain one (the Triton JSD included)."""
    chunk_size, backend = PATHS[path]
    _skip_without_triton(backend)
    kind, beta = LOSSES[case]
    s, t, mask = _inputs(where)
    kw = {"loss": kind, "beta": beta, "mask": mask, "temperature": temperature}
    out = divergence(s, t, **kw, chunk_size=chunk_size, backend=backend)
    (g,) = torch.autograd.grad(out, s)
    log_p = F.log_softmax(t.double() / temperature, dim=-1)
    ref, g_ref = _float64(kind, s, log_p, mask, temperature, beta)
    _check(out, g, ref, g_ref, s, t, mask, temperature, f"{path} vs float64")
    if where == "both":
        assert torch.equal(g[:, DEAD], torch.zeros_like(g[:, DEAD]))
    plain = divergence(s, t, **kw, chunk_size=None)
    (g_plain,) = torch.autograd.grad(plain, s)
    _check(out, g, plain.double(), g_plain.double(), s, t, mask, temperature, f"{path} vs plain")


@pytest.mark.interpreter
@pytest.mark.filterwarnings(NUMPY_NAN_WARNINGS)
@pytest.mark.parametrize("path", list(PATHS))
def test_reverse_kl_is_infinite_where_only_the_teacher_is_neg_inf(path):
    chunk_size, backend = PATHS[path]
    _skip_without_triton(backend)
    s, t, mask = _inputs("teacher")
    out = divergence(s, t, loss="reverse_kl", mask=mask, chunk_size=chunk_size, backend=backend)
    assert out.item() == math.inf  # the student has mass where the teacher has none


@pytest.mark.parametrize("chunk_size", [None, 4])
@pytest.mark.parametrize("case", ["forward_kl", "jsd_0.3"])
def test_top_k_teacher_holding_neg_inf(case, chunk_size):
    """k larger than the teacher's finite logits: the top-k values hold ``-inf``."""
    kind, beta = LOSSES[case]
    s, t, mask = _inputs("teacher")
    k = V - len(DEAD) + 5
    top = torch.topk(t, k, dim=-1)
    assert top.values.isneginf().any()
    out = divergence(
        s, top, loss=kind, beta=beta, mask=mask, temperature=2.0, chunk_size=chunk_size
    )
    (g,) = torch.autograd.grad(out, s)
    ref, g_ref = _float64(kind, s, F.log_softmax(t.double() / 2.0, -1), mask, 2.0, beta)
    _check(out, g, ref, g_ref, s, t, mask, 2.0, "top-k vs float64")


# ------------------------------------------------------------------------------------- masks
@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["plain", "chunked", "chunked_1024", "triton"])
@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("mask_shape", [(2, 8), (2, 6), (1,), ()])
def test_a_mask_of_another_size_is_refused_naming_mask(mask_shape, loss, path):
    """E.g. the unshifted (B, S) attention mask with shifted (B, S - 1) logits, or one element
    (which would broadcast into a token sum)."""
    chunk_size, backend = PATHS.get(path, (1024, "torch"))
    _skip_without_triton(backend)
    s, t = torch.randn(2, 7, 11, requires_grad=True), torch.randn(2, 7, 11)
    mask = torch.ones(mask_shape)
    expected = rf"`mask` has shape {re.escape(str(mask_shape))} .* expected shape \(2, 7\)"
    with pytest.raises(ValueError, match=expected):
        divergence(s, t, loss=loss, mask=mask, chunk_size=chunk_size, backend=backend)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_a_flat_mask_with_one_entry_per_row_is_the_same_mask(chunk_size):
    s, t = torch.randn(2, 7, 11), torch.randn(2, 7, 11)
    mask = torch.rand(2, 7) > 0.4
    flat = divergence(s, t, mask=mask.reshape(-1), chunk_size=chunk_size)
    assert torch.equal(flat, divergence(s, t, mask=mask, chunk_size=chunk_size))
    rows = s.reshape(-1, 11)[mask.reshape(-1)]
    dense = divergence(rows, t.reshape(-1, 11)[mask.reshape(-1)], chunk_size=None)
    torch.testing.assert_close(flat, dense, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------- teacher gradients
@pytest.mark.parametrize("neg_inf", [False, True])
@pytest.mark.parametrize(
    ("case", "top_k"),
    [("forward_kl", None), ("forward_kl", 9), ("reverse_kl", None), ("jsd_0.3", None),
     ("jsd_0.3", 9)],
)  # fmt: skip
def test_chunked_path_gives_the_teacher_the_autograd_gradient(case, top_k, neg_inf):
    kind, beta = LOSSES[case]
    gen = torch.Generator().manual_seed(3)
    s = (torch.randn(2, 5, 13, generator=gen) * 2).requires_grad_()
    t = torch.randn(2, 5, 13, generator=gen) * 2
    if neg_inf:
        t[..., :3] = NEG_INF
        if kind == "reverse_kl":
            s.data[..., :3] = NEG_INF
    mask = torch.rand(2, 5, generator=gen) > 0.3
    if top_k is None:
        leaf = t.requires_grad_()
        teacher = leaf
    else:
        top = torch.topk(t, top_k, dim=-1)
        leaf = top.values.clone().requires_grad_()
        teacher = (leaf, top.indices)
    kw = {"loss": kind, "beta": beta, "mask": mask, "temperature": 1.5}
    ref = divergence(s, teacher, **kw, chunk_size=None)
    g_s_ref, g_t_ref = torch.autograd.grad(ref, (s, leaf))
    out = divergence(s, teacher, **kw, chunk_size=3, backend="torch")
    g_s, g_t = torch.autograd.grad(out * 2.0, (s, leaf))  # scaled by the incoming gradient
    assert torch.isfinite(g_t).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_s, 2.0 * g_s_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_t, 2.0 * g_t_ref, rtol=1e-5, atol=1e-6)
    assert g_t.abs().max() > 1e-3  # a real gradient, not zeros


def test_teacher_gradient_alone():
    """A teacher that requires grad beside a student that does not."""
    s = torch.randn(4, 9)
    t = torch.randn(4, 9, requires_grad=True)
    ref = divergence(s, t, loss="jsd", beta=0.4, chunk_size=None)
    (g_ref,) = torch.autograd.grad(ref, t)
    (g,) = torch.autograd.grad(divergence(s, t, loss="jsd", beta=0.4, chunk_size=2), t)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-7)


def test_fused_kernel_refuses_a_teacher_needing_grad_and_auto_avoids_it(monkeypatch):
    s, t = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    if K.available(s.device):
        with pytest.raises(ValueError, match="`teacher` requires grad"):
            divergence(s, t, backend="triton")
    monkeypatch.setattr(K, "HAS_TRITON", True)
    cuda = torch.device("cuda")  # only its type is read
    assert resolve_path("auto", t, cuda, 1024) == "torch"
    assert resolve_path("auto", t.detach(), cuda, 1024) == "triton"
    with torch.no_grad():
        assert resolve_path("auto", t, cuda, 1024) == "triton"
