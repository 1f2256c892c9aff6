"""Stochastic rounding of bf16 parameters: unbiased in expectation, keeps sub-ulp updates."""

import numpy as np
import pytest
import torch

from leanlm_testing import optim
from leanlm_testing.kernels import device_or_skip
from optim_adafactor import Adafactor, _kernels
from optim_adafactor._stochastic import copy_stochastic_


def _one_step(p0: torch.Tensor, g: torch.Tensor, **kw) -> torch.Tensor:
    p = p0.clone().requires_grad_()
    opt = Adafactor([p], lr=1e-3, relative_step=False, scale_parameter=False, **kw)
    p.grad = g.to(p.dtype)
    opt.step()
    return p.detach()


def test_mean_of_rounded_updates_matches_fp32_update() -> None:
    optim.check_sr_keeps_sub_ulp_updates(
        lambda ps, sr: Adafactor(
            ps, lr=1e-3, relative_step=False, scale_parameter=False, stochastic_rounding=sr
        )
    )


def test_stochastic_rounding_only_rounds_to_neighbours() -> None:
    x = torch.rand(1000) * 10 - 5
    out = torch.empty(1000, dtype=torch.bfloat16)
    copy_stochastic_(out, x.clone())
    down = x.bfloat16().float()  # nearest; neighbours are nearest and the next one over
    ulp = torch.where(x.abs() > 0, 2.0 ** (torch.floor(torch.log2(x.abs())) - 7), 1e-30)
    assert ((out.float() - x).abs() <= ulp * 1.0001).all()
    assert ((out.float() - down).abs() <= ulp * 1.0001).all()


def test_stochastic_rounding_rejects_wrong_dtypes() -> None:
    with pytest.raises(TypeError, match="bf16"):
        copy_stochastic_(torch.empty(3), torch.zeros(3))


def test_stochastic_rounding_is_ignored_for_fp32_params() -> None:
    p0 = torch.randn(8, 8)
    g = torch.randn(8, 8)
    assert torch.equal(_one_step(p0, g, stochastic_rounding=True), _one_step(p0, g))


def test_rounding_noise_is_fresh_per_step_and_per_parameter_yet_reproducible() -> None:
    """The noise is a function of (seed, step, index): new each step and for each parameter,
    the same for an optimizer that loaded the state dict (a resume continues it exactly)."""
    gen = torch.Generator().manual_seed(0)
    p0 = (1.0 + torch.rand(32, 48, generator=gen)).bfloat16()  # ulp 2^-7, updates below half
    g = torch.randn(32, 48, generator=gen).bfloat16()
    params = [p0.clone().requires_grad_() for _ in range(2)]
    kw = {"lr": 1e-3, "relative_step": False, "scale_parameter": False}
    opt = Adafactor(params, stochastic_rounding=True, **kw)
    moved = []
    for _ in range(2):
        before = [p.detach().clone() for p in params]
        for p in params:
            p.grad = g.clone()
        opt.step()
        moved.append([(p.detach() != b) for p, b in zip(params, before, strict=True)])
    assert 0.05 < moved[0][0].float().mean() < 0.95  # some elements rounded away, some not
    assert not torch.equal(moved[0][0], moved[1][0])  # step 2's noise is not step 1's
    assert not torch.equal(moved[0][0], moved[0][1])  # the second parameter's is its own
    resumed = [p.detach().clone().requires_grad_() for p in params]
    again = Adafactor(resumed, stochastic_rounding=True, **kw)
    again.load_state_dict(opt.state_dict())
    for p, q in zip(params, resumed, strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    again.step()
    assert all(torch.equal(p, q) for p, q in zip(params, resumed, strict=True))


def _philox4x32_10(seed: int, counters: np.ndarray) -> list[np.ndarray]:
    """Philox4x32-10 of (counter lo, counter hi, 0, 0) with key (seed, 0): `tl.randint4x`'s."""
    zero = np.zeros_like(counters)
    c = [counters & np.uint64(0xFFFFFFFF), counters >> np.uint64(32), zero, zero]
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(0)
    a, b, mask = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57), np.uint64(0xFFFFFFFF)
    for _ in range(10):  # products of two 32-bit values are exact in uint64
        pa, pb = a * c[0], b * c[2]
        c = [(pb >> np.uint64(32)) ^ c[1] ^ k0, pb & mask, (pa >> np.uint64(32)) ^ c[3] ^ k1,
             pa & mask]  # fmt: skip
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return c


if _kernels.HAS_TRITON:
    import triton
    import triton.language as tl

    from optim_adafactor.factored import sr_counters, stochastic_round_bf16

    @triton.jit
    def _round_kernel(x_ptr, out_ptr, seed, n_rows, n_cols, BLOCK_N: tl.constexpr,  # noqa: N803
                      BLOCK_M: tl.constexpr):  # noqa: N803  # fmt: skip
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        for start in range(0, n_cols, BLOCK_M):
            cols = start + tl.arange(0, BLOCK_M)
            mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
            offs = rows[:, None] * n_cols + cols[None, :]
            x = tl.load(x_ptr + offs, mask=mask)
            y = stochastic_round_bf16(x, seed, sr_counters(rows, start, n_cols, BLOCK_M))
            tl.store(out_ptr + offs, y, mask=mask)


@pytest.mark.interpreter
def test_kernel_noise_is_one_philox_draw_per_8_columns() -> None:
    """Element (r, c) of an n-column tensor takes the 16 bits `(c % 8) % 2` (low, high) of output
    `(c % 8) // 2` of Philox4x32-10(seed, r·⌈n/8⌉ + c // 8): all 128 bits of a draw, once each.

    Odd columns (a partial group ends every row), two row tiles and three column tiles; fp32
    inputs with random low bits, so a wrong half or output changes about a third of the results.
    """
    dev = device_or_skip(_kernels)
    n, m, seed = 6, 45, 987654321
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, m, generator=gen)
    out = torch.empty_like(x, device=dev)
    _round_kernel[(2,)](x.to(dev), out, seed, n, m, BLOCK_N=4, BLOCK_M=16)
    rows, cols = np.meshgrid(np.arange(n), np.arange(m), indexing="ij")
    words = _philox4x32_10(seed, (rows * -(-m // 8) + cols // 8).astype(np.uint64))
    slot = cols % 8
    word = np.choose(slot // 2, words)
    half = (16 * (slot % 2)).astype(np.uint64)
    noise = torch.from_numpy(((word >> half) & 0xFFFF).astype(np.int64))
    bits = x.view(torch.int32).to(torch.int64) + noise
    want = (bits & 0xFFFF0000).to(torch.int32).view(torch.float32)  # back to int32 bit patterns
    assert torch.equal(out.cpu(), want)
