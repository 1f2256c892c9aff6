"""int8 `exp_avg` in the fused kernels (decode -> update -> encode in the momentum pass, decode
in the apply pass; per tensor and multi-tensor) against the PyTorch reference, interpreted."""

import pytest
import torch

from leanlm_testing import assert_verbose_allclose
from leanlm_testing.kernels import device_or_skip
from optim_came import CAME, _kernels, _quant

pytestmark = pytest.mark.interpreter
SHAPES = {"odd": (13, 7), "tail_batch": (3, 37, 50), "partial_block": (5, 300), "pow2": (16, 256)}


def _codes(shape, dev):
    x = torch.randn(shape, device=dev)
    codes = torch.empty(shape, dtype=torch.int8, device=dev)
    scale = torch.empty(_quant.scale_shape(shape), device=dev)
    _quant.quantize_(x, codes, scale)
    return codes, scale


@pytest.mark.parametrize("sr_seed", [None, 1234])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_momentum_kernel_int8_matches_reference(shape_name, sr_seed) -> None:
    dev = device_or_skip(_kernels)
    shape = SHAPES[shape_name]
    g = torch.randn(shape, device=dev)
    codes, scale = _codes(shape, dev)
    g3, c3 = g.reshape(-1, *shape[-2:]), codes.view(-1, *shape[-2:])
    b, n, m = g3.shape
    blocks = -(-n // _kernels.BLOCK_N)
    rs, cf = torch.rand(b, n, device=dev) + 0.5, torch.rand(b, m, device=dev) + 0.5
    mom = _quant.dequantize(codes, scale).reshape(b, n, m)
    ref_row, ref_col = _kernels.momentum_reference(g3, mom, rs, cf, 0.9)
    ref_codes, ref_scale = torch.empty_like(codes), torch.empty_like(scale)
    noise = None if sr_seed is None else _quant.hash_uniform(sr_seed, 0, shape, g.device)
    _quant.quantize_(mom.view(shape), ref_codes, ref_scale, noise=noise)
    rowsum, colpart = torch.zeros(b, n, device=dev), torch.zeros(b, blocks, m, device=dev)
    bm, _ = _kernels.launch_config(m, quant=True)
    _kernels._momentum_kernel[(b, blocks)](
        g3, c3, rs, cf, rowsum, colpart, 0.9, n, m, blocks, BLOCK_N=_kernels.BLOCK_N,
        BLOCK_M=bm, scale_ptr=scale, qseed=_kernels.quant_seed(sr_seed), QUANT=True,
        QSR=sr_seed is not None,
    )  # fmt: skip
    assert torch.equal(scale, ref_scale)
    assert torch.equal(codes, ref_codes)  # the interpreter's fp32 math is the reference's
    assert_verbose_allclose(rowsum, ref_row, atol=1e-6, rtol=1e-5, name="d² row sums")
    assert_verbose_allclose(colpart.sum(1), ref_col, atol=1e-6, rtol=1e-5, name="d² col sums")


@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_apply_kernel_int8_matches_reference(shape_name) -> None:
    dev = device_or_skip(_kernels)
    shape = SHAPES[shape_name]
    codes, scale = _codes(shape, dev)
    p3 = torch.randn(shape, device=dev).reshape(-1, *shape[-2:])
    b, n, m = p3.shape
    rrs, cr = torch.randn(b, n, device=dev) * 1e-2, torch.rand(b, m, device=dev) + 0.5
    ref = p3.clone()
    _kernels.apply_reference(ref, _quant.dequantize(codes, scale).view(b, n, m), rrs, cr, 1e-2)
    bm, _ = _kernels.launch_config(m, quant=True)
    _kernels._apply_kernel[(b, -(-n // _kernels.BLOCK_N))](
        p3, codes, rrs, cr, torch.full((1,), 1e-2, device=dev), 0, n, m, HAS_DECAY=True,
        SR=False, BLOCK_N=_kernels.BLOCK_N, BLOCK_M=bm, scale_ptr=scale, QUANT=True,
    )  # fmt: skip
    assert_verbose_allclose(p3, ref, atol=1e-6, rtol=1e-6, name="p")


@pytest.mark.parametrize("multi_tensor", [False, True])
@pytest.mark.parametrize("sr", [False, True])
def test_fused_int8_optimizer_matches_torch_path(sr, multi_tensor) -> None:
    dev = device_or_skip(_kernels)
    kw = {"lr": 1e-2, "weight_decay": 0.1, "state_dtype": torch.int8, "stochastic_rounding": sr}
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen).to(dev) for s in SHAPES.values()]
    a = [t.clone().requires_grad_() for t in init]
    b = [t.clone().requires_grad_() for t in init]
    fused, eager = CAME(a, backend="triton", **kw), CAME(b, backend="torch", **kw)
    fused._sr_seed = eager._sr_seed
    fused.multi_tensor = multi_tensor
    for _ in range(3):
        grads = [torch.randn(t.shape, generator=gen).to(dev) for t in init]
        for p, q, g in zip(a, b, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        fused.step()
        eager.step()
        assert bool(fused._multi_cache) == multi_tensor  # 2-D matrices batched, or not
    for p, q in zip(a, b, strict=True):
        assert_verbose_allclose(p, q, atol=1e-6, rtol=1e-5, name=f"p {tuple(p.shape)}")
        codes, ref = fused.state[p]["exp_avg"], eager.state[q]["exp_avg"]
        assert codes.dtype == torch.int8
        # fp32 sums in another order may flip a code at a rounding boundary, by one
        assert (codes.int() - ref.int()).abs().max() <= 1
        assert (codes != ref).float().mean() < 1e-2
