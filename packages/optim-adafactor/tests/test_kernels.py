"""Triton kernels vs their PyTorch references, and the fused optimizer vs the PyTorch path.

Interpreter tests run at small shapes on CPU (TRITON_INTERPRET=1); `gpu` tests at real sizes.
Tolerances: fp32 sums in a different order (tile-wise) differ by a few ulp: rtol 1e-5.
"""

import pytest
import torch

from leanlm_testing import assert_verbose_allclose
from leanlm_testing.kernels import (
    KERNEL_SHAPES,
    check_low_precision_state,
    device_or_skip,
    no_host_sync,
)
from optim_adafactor import Adafactor, _kernels
from optim_adafactor._kernels import apply_reference, stats_reference, sumsq_reference

pytestmark = pytest.mark.skipif(not _kernels.HAS_TRITON, reason="triton is not installed")

SHAPES = KERNEL_SHAPES


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_stats_and_sumsq_kernels_match_reference(shape_name: str, dtype: torch.dtype) -> None:
    dev = device_or_skip(_kernels)
    g = torch.randn(SHAPES[shape_name], device=dev).to(dtype)
    p = torch.randn(SHAPES[shape_name], device=dev).to(dtype)
    g3, p3 = _kernels._as_3d(g), _kernels._as_3d(p)
    b, n, m = g3.shape
    blocks = -(-n // _kernels.BLOCK_N)
    rowsum = torch.empty(b, n, device=dev)
    colpart = torch.empty(b, blocks, m, device=dev)
    ppart = torch.empty(b * blocks, device=dev)
    _kernels._stats_kernel[(b, blocks)](
        g3, p3, rowsum, colpart, ppart, n, m, blocks,
        HAS_P=True, BLOCK_N=_kernels.BLOCK_N, BLOCK_M=_kernels.BLOCK_M,
    )  # fmt: skip
    ref_row, ref_colpart, ref_ppart = stats_reference(g3, p3)
    assert_verbose_allclose(rowsum, ref_row, atol=1e-6, rtol=1e-5, name="row sums")
    assert_verbose_allclose(colpart, ref_colpart, atol=1e-6, rtol=1e-5, name="col partials")
    assert_verbose_allclose(ppart, ref_ppart, atol=1e-5, rtol=1e-5, name="p² partials")

    rf, cf = torch.rand(b, n, device=dev) + 0.5, torch.rand(b, m, device=dev) + 0.5
    upart = torch.zeros(b * blocks, device=dev)
    _kernels._sumsq_kernel[(b, blocks)](
        g3, rf, cf, upart, n, m, blocks, BLOCK_N=_kernels.BLOCK_N, BLOCK_M=_kernels.BLOCK_M
    )
    ref = sumsq_reference(g3, rf, cf)
    assert_verbose_allclose(upart.sum(), ref, atol=1e-5, rtol=1e-5, name="Σu²")


@pytest.mark.interpreter
@pytest.mark.parametrize("momentum", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_apply_kernel_matches_reference(shape_name: str, dtype: torch.dtype, momentum: bool):
    dev = device_or_skip(_kernels)
    shape = SHAPES[shape_name]
    g = torch.randn(shape, device=dev).to(dtype)
    p = torch.randn(shape, device=dev).to(dtype)
    g3, p3 = _kernels._as_3d(g), _kernels._as_3d(p)
    b, n, m = g3.shape
    blocks = -(-n // _kernels.BLOCK_N)
    mom = torch.randn(b, n, m, device=dev) if momentum else None
    rs, cf = torch.randn(b, n, device=dev) * 1e-2, torch.rand(b, m, device=dev) + 0.5
    decay = torch.tensor([1e-2], device=dev)  # weight_decay · lr_t
    p_ref, m_ref = p3.clone(), None if mom is None else mom.clone()
    _kernels._apply_kernel[(b, blocks)](
        g3, p3, mom if mom is not None else g3, rs, cf, decay, 0.9, 0, n, m,
        HAS_M=momentum, HAS_DECAY=True, SR=False,
        BLOCK_N=_kernels.BLOCK_N, BLOCK_M=_kernels.BLOCK_M,
    )  # fmt: skip
    apply_reference(g3, p_ref, m_ref, rs, cf, decay, 0.9)
    # bf16: the interpreter truncates f32->bf16 casts (reference rounds): one bf16 ulp
    atol, rtol = (1e-6, 1e-5) if dtype == torch.float32 else (1e-2, 2**-7)
    assert_verbose_allclose(p3, p_ref, atol=atol, rtol=rtol, name="param")
    if mom is not None:
        assert_verbose_allclose(mom, m_ref, atol=1e-6, rtol=1e-5, name="exp_avg")


FUSED_COMBOS = {
    "default": {},
    "momentum_wd": {"beta1": 0.9, "weight_decay": 0.1},
    "external_lr_noclip": {
        "lr": 1e-2, "relative_step": False, "scale_parameter": False, "clip_threshold": None,
    },
    "maximize": {"maximize": True, "beta1": 0.5},
    "t2t_unscaled": {"semantics": "t2t", "scale_parameter": False},
}  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.parametrize("combo", list(FUSED_COMBOS))
def test_fused_optimizer_matches_torch_path(combo: str) -> None:
    dev = device_or_skip(_kernels)
    kw = FUSED_COMBOS[combo]
    shapes = [(13, 7), (3, 9, 20), (11,)]
    p0 = [torch.randn(s, device=dev) for s in shapes]
    pa = [p.clone().requires_grad_() for p in p0]
    pb = [p.clone().requires_grad_() for p in p0]
    oa = Adafactor(pa, backend="torch", **kw)
    ob = Adafactor(pb, backend="triton", **kw)
    for _ in range(12):
        for a, b in zip(pa, pb, strict=True):
            g = torch.randn(a.shape, device=dev) * 10 ** torch.empty(()).uniform_(-3, 1).item()
            a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    for i, (a, b) in enumerate(zip(pa, pb, strict=True)):
        assert_verbose_allclose(b, a, atol=1e-6, rtol=1e-5, name=f"param {i}")
        for key, value in oa.state[a].items():
            if isinstance(value, torch.Tensor):
                atol = 1e-5 * float(value.abs().max())
                assert_verbose_allclose(ob.state[b][key], value, atol=atol, rtol=1e-5, name=key)


@pytest.mark.interpreter
def test_fused_bf16_params_follow_torch_path() -> None:
    dev = device_or_skip(_kernels)
    p0 = torch.randn(20, 24, device=dev).bfloat16()
    a, b = p0.clone().requires_grad_(), p0.clone().requires_grad_()
    oa, ob = Adafactor([a], backend="torch"), Adafactor([b], backend="triton")
    steps = 4
    for _ in range(steps):
        g = torch.randn(20, 24, device=dev).bfloat16()
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert b.dtype == torch.bfloat16
    assert ob.state[b]["exp_avg_sq_row"].dtype == torch.float32
    # the interpreter truncates f32->bf16 stores (up to one ulp lost per step); CUDA rounds
    rtol = (steps + 1) * 2**-7 if _kernels._INTERPRET else 2**-7
    assert_verbose_allclose(b, a, atol=1e-2, rtol=rtol, name="bf16 param")


@pytest.mark.interpreter
def test_fused_stochastic_rounding_is_unbiased() -> None:
    """A constant sub-ulp update on bf16: the mean over many elements matches fp32."""
    dev = device_or_skip(_kernels)
    n, m = 32, 64
    p = torch.ones(n, m, device=dev, dtype=torch.bfloat16)
    g = torch.ones(1, 1, n, m, device=dev)
    mom = None
    rs = torch.full((1, n), 1e-3, device=dev)  # update 1e-3 << bf16 ulp at 1.0 (2^-7)
    cf = torch.ones(1, m, device=dev)
    p3 = p.view(1, n, m)
    _kernels._apply_kernel[(1, n // _kernels.BLOCK_N)](
        g, p3, g, rs, cf, rs, 0.0, 1234, n, m,
        HAS_M=mom is not None, HAS_DECAY=False, SR=True,
        BLOCK_N=_kernels.BLOCK_N, BLOCK_M=_kernels.BLOCK_M,
    )  # fmt: skip
    values = p.float()
    assert set(values.unique().tolist()) <= {1.0 - 2**-8, 1.0}  # neighbours of 1 - 1e-3
    # E[value] = 1 - 1e-3; std of the mean of K Bernoulli(p≈0.256) steps of 2^-8: ~2.4e-5
    assert abs(values.mean().item() - (1.0 - 1e-3)) < 5 * 2**-8 * (0.26 * 0.74 / (n * m)) ** 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (11008, 4096), (32000, 1024), (4, 1024, 3000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_torch_path_at_real_sizes(shape, dtype) -> None:
    p0 = torch.randn(shape, device="cuda").to(dtype)
    a, b = p0.clone().requires_grad_(), p0.clone().requires_grad_()
    oa = Adafactor([a], backend="torch", beta1=0.9, weight_decay=0.01)
    ob = Adafactor([b], backend="triton", beta1=0.9, weight_decay=0.01)
    for _ in range(5):
        g = torch.randn(shape, device="cuda").to(dtype)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    atol, rtol = (1e-6, 1e-5) if dtype == torch.float32 else (1e-2, 2**-7)
    assert_verbose_allclose(b, a, atol=atol, rtol=rtol, name="param")


@pytest.mark.gpu
def test_fused_step_makes_no_host_sync() -> None:
    params = [torch.randn(512, 384, device="cuda", requires_grad=True) for _ in range(3)]
    opt = Adafactor(params, beta1=0.9, weight_decay=0.1, backend="triton")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # compile the kernels first
    with no_host_sync():
        opt.step()


def _int8_momentum(sr: bool):
    kw = {"lr": 1e-3, "relative_step": False, "beta1": 0.9, "weight_decay": 0.01}
    kw |= {"state_dtype": torch.int8, "stochastic_rounding": sr}
    return lambda params, backend: Adafactor(params, backend=backend, **kw)


@pytest.mark.interpreter
@pytest.mark.parametrize("sr", [False, True])
def test_int8_momentum_parity_check_on_the_interpreter(sr: bool) -> None:
    """The GPU test's check at small odd shapes (the interpreter's fp32 math moves no code)."""
    dev = device_or_skip(_kernels)
    check_low_precision_state(_int8_momentum(sr), dev, [(13, 7), (10, 300), (2, 5, 130), (17,)])


@pytest.mark.gpu
@pytest.mark.parametrize("sr", [False, True])
def test_int8_momentum_matches_torch_path_at_real_sizes(sr: bool) -> None:
    """The 8-bit momentum on the GPU (never run there before): multi-tensor matrices, a
    per-tensor 3-D parameter and a vector, 3 steps."""
    shapes = [(4096, 1024), (1024, 2816), (32000, 512), (3, 1024, 1000), (4096,)]
    check_low_precision_state(_int8_momentum(sr), "cuda", shapes)
