"""Triton kernels vs their PyTorch references, and the fused optimizer vs the PyTorch path.

Interpreter tests (`interpreter`) run small shapes on CPU with TRITON_INTERPRET=1; `gpu` tests run
real sizes on CUDA. Tolerances: fp32 sums in a different (tile-wise) order differ by a few ulp
(rtol 1e-5); over many optimizer steps they compound like the reordering in test_parity.py.
"""

import pytest
import torch

from leanlm_testing import assert_verbose_allclose
from leanlm_testing.kernels import KERNEL_SHAPES, check_low_precision_state, device_or_skip
from optim_came import CAME, _kernels

pytestmark = pytest.mark.skipif(not _kernels.HAS_TRITON, reason="triton is not installed")

SHAPES = KERNEL_SHAPES


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def _random_3d(shape_name: str, dtype: torch.dtype):
    """(device, an N(0, 1) (b, n, m) tensor of `SHAPES[shape_name]`, its shape, row blocks)."""
    dev = device_or_skip(_kernels)
    t3 = _as_3d(torch.randn(SHAPES[shape_name], device=dev).to(dtype))
    return dev, t3, t3.shape, -(-t3.shape[1] // _kernels.BLOCK_N)


@pytest.mark.interpreter
@pytest.mark.parametrize("m_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_momentum_kernel_matches_reference(shape_name, dtype, m_dtype) -> None:
    dev, g3, (b, n, m), blocks = _random_3d(shape_name, dtype)
    mom = torch.randn(b, n, m, device=dev).to(m_dtype)
    rs, cf = torch.rand(b, n, device=dev) + 0.5, torch.rand(b, m, device=dev) + 0.5
    ref_m = mom.clone()
    rowsum = torch.zeros(b, n, device=dev)
    colpart = torch.zeros(b, blocks, m, device=dev)
    _kernels._momentum_kernel[(b, blocks)](
        g3, mom, rs, cf, rowsum, colpart, 0.9, n, m, blocks,
        BLOCK_N=_kernels.BLOCK_N, BLOCK_M=_kernels.BLOCK_M,
    )  # fmt: skip
    ref_row, ref_col = _kernels.momentum_reference(g3, ref_m, rs, cf, 0.9)
    # bf16 m: the interpreter truncates f32->bf16 casts, torch rounds: one bf16 ulp apart
    tol = 1e-5 if m_dtype == torch.float32 else 2**-7
    assert_verbose_allclose(mom.float(), ref_m.float(), atol=1e-6, rtol=tol, name="m")
    assert_verbose_allclose(rowsum, ref_row, atol=1e-6, rtol=1e-5, name="d² row sums")
    assert_verbose_allclose(colpart.sum(1), ref_col, atol=1e-6, rtol=1e-5, name="d² col sums")


@pytest.mark.interpreter
@pytest.mark.parametrize("wd_lr", [0.0, 1e-2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_apply_kernel_matches_reference(shape_name, dtype, wd_lr) -> None:
    dev, p3, (b, n, m), blocks = _random_3d(shape_name, dtype)
    mom = torch.randn(b, n, m, device=dev)
    rrs, cr = torch.randn(b, n, device=dev) * 1e-2, torch.rand(b, m, device=dev) + 0.5
    ref = p3.clone()
    _kernels._apply_kernel[(b, blocks)](
        p3, mom, rrs, cr, torch.full((1,), wd_lr, device=dev), 0, n, m,
        HAS_DECAY=wd_lr != 0.0, SR=False, BLOCK_N=_kernels.BLOCK_N, BLOCK_M=_kernels.BLOCK_M,
    )  # fmt: skip
    _kernels.apply_reference(ref, mom, rrs, cr, wd_lr)
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    assert_verbose_allclose(p3.float(), ref.float(), atol=1e-6, rtol=tol, name="p")


@pytest.mark.interpreter
def test_apply_kernel_stochastic_rounding_is_unbiased() -> None:
    dev = device_or_skip(_kernels)
    n, m = 64, 64
    p = torch.ones(1, n, m, device=dev, dtype=torch.bfloat16)  # ulp above 1.0: 2^-7
    mom = torch.ones(1, n, m, device=dev)
    rrs, cr = torch.full((1, n), 1e-3, device=dev), torch.ones(1, m, device=dev)
    _kernels._apply_kernel[(1, n // _kernels.BLOCK_N)](
        p, mom, rrs, cr, rrs, 1234, n, m, HAS_DECAY=False, SR=True,
        BLOCK_N=_kernels.BLOCK_N, BLOCK_M=_kernels.BLOCK_M,
    )  # fmt: skip
    exact = 1.0 - 1e-3  # below half an ulp under 1.0 (2^-9): round-to-nearest gives 1.0
    values = p.float()
    assert set(values.unique().tolist()) <= {1.0, 1.0 - 2**-8}
    # 4096 Bernoulli draws: the mean's std <= 2^-8 / (2·64); allow 6 sigma
    assert abs(values.mean().item() - exact) < 6 * 2**-8 / 128


CONFIGS = {
    "default": {},
    "extras": {"weight_decay": 0.1, "bias_correction": True, "instability_init": 1.0},
    "bf16_state": {"state_dtype": torch.bfloat16},
}


@pytest.mark.interpreter
@pytest.mark.parametrize("config", list(CONFIGS))
def test_fused_optimizer_matches_torch_path(config: str) -> None:
    dev = device_or_skip(_kernels)
    shapes = [(13, 7), (2, 17, 9), (5,)]
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen).to(dev) for s in shapes]
    fused = [t.clone().requires_grad_() for t in init]
    eager = [t.clone().requires_grad_() for t in init]
    kw = {"lr": 1e-2, **CONFIGS[config]}
    opt_f, opt_e = CAME(fused, backend="triton", **kw), CAME(eager, backend="torch", **kw)
    for _ in range(8):
        for a, b in zip(fused, eager, strict=True):
            g = torch.randn(a.shape, generator=gen).to(dev)
            a.grad, b.grad = g, g.clone()
        opt_f.step()
        opt_e.step()
    # bf16 m: the interpreter truncates f32->bf16 stores where torch rounds to nearest, a bias
    # of up to 1 ulp (2^-8 relative) per step that the momentum accumulates over ~1/(1-β1) steps
    tol = 1e-5 if config != "bf16_state" else 3e-2
    for a, b in zip(fused, eager, strict=True):
        scale = b.abs().max().item()
        assert_verbose_allclose(a, b, atol=tol * scale, rtol=tol, name=f"{config} {a.shape}")
        for key, value in opt_e.state[b].items():
            if isinstance(value, torch.Tensor):
                other = opt_f.state[a][key]
                assert other.dtype == value.dtype
                s = value.float().abs().max().item()
                assert_verbose_allclose(other.float(), value.float(), atol=tol * s, rtol=tol)


@pytest.mark.interpreter
def test_fused_bf16_params_with_stochastic_rounding_stay_close() -> None:
    dev = device_or_skip(_kernels)
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(16, 24, generator=gen).to(dev)
    fused = init.bfloat16().requires_grad_()
    eager = init.bfloat16().float().requires_grad_()
    opt_f = CAME([fused], lr=1e-3, backend="triton", stochastic_rounding=True)
    opt_e = CAME([eager], lr=1e-3, backend="torch")
    for _ in range(5):
        g = torch.randn(16, 24, generator=gen).to(dev)
        fused.grad, eager.grad = g.bfloat16(), g.bfloat16().float()
        opt_f.step()
        opt_e.step()
    assert fused.dtype == torch.bfloat16
    # each step rounds to a bf16 neighbour (error < 1 ulp ≈ 2^-7 relative), 5 steps
    assert_verbose_allclose(fused.float(), eager, atol=1e-2, rtol=5 * 2**-7)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_torch_path_at_real_sizes(dtype) -> None:
    shapes = [(4096, 1024), (1024, 2816), (32000, 512), (3, 1024, 1000), (4096,)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    init = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
    fused = [t.clone().requires_grad_() for t in init]
    eager = [t.clone().requires_grad_() for t in init]
    opt_f = CAME(fused, lr=1e-3, weight_decay=0.1, backend="triton")
    opt_e = CAME(eager, lr=1e-3, weight_decay=0.1, backend="torch")
    for _ in range(10):
        for a, b in zip(fused, eager, strict=True):
            g = torch.randn(a.shape, device="cuda", generator=gen).to(dtype)
            a.grad, b.grad = g, g.clone()
        opt_f.step()
        opt_e.step()
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    for a, b in zip(fused, eager, strict=True):
        scale = b.float().abs().max().item()
        assert_verbose_allclose(a.float(), b.float(), atol=tol * scale, rtol=tol)


@pytest.mark.interpreter
@pytest.mark.parametrize("sr", [False, True])
def test_int8_state_parity_check_on_the_interpreter(sr: bool) -> None:
    """The GPU test's check at small odd shapes (the interpreter's bf16 stores truncate, so
    only int8 here; its exact fp32 math moves no code)."""
    dev = device_or_skip(_kernels)
    shapes = [(13, 7), (10, 300), (2, 5, 130), (17,)]
    check_low_precision_state(_came(torch.int8, sr), dev, shapes)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("state_dtype", "sr"), [(torch.bfloat16, False), (torch.int8, False), (torch.int8, True)]
)
def test_low_precision_state_matches_torch_path_at_real_sizes(state_dtype, sr) -> None:
    """bf16 and int8 first moments (the 1.1B runs' configurations) on the GPU: multi-tensor
    matrices, a per-tensor 3-D parameter and a vector, 3 steps."""
    shapes = [(4096, 1024), (1024, 2816), (32000, 512), (3, 1024, 1000), (4096,)]
    check_low_precision_state(_came(state_dtype, sr), "cuda", shapes)


def _came(state_dtype: torch.dtype, sr: bool):
    kw = {"lr": 1e-3, "weight_decay": 0.1, "state_dtype": state_dtype, "stochastic_rounding": sr}
    return lambda params, backend: CAME(params, backend=backend, **kw)
