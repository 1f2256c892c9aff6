"""The vectorized quantizer (`_quant`) equals the map's direct formula bit for bit.

`_direct_quantize` / `_direct_hash` are the map written out plainly (padded blocks, the exact
floor of √a with both corrections, the fp32 quotient `(a - lo²)/(2lo+1)`, int64 hashing): the
form the PyTorch path had before it was made allocation-free, and the one the Triton kernels
encode. Inputs sit on and around every rounding threshold and square, in partial blocks, with
signed zeros and a block whose absmax is subnormal (127²/absmax overflows), for block absmaxes
where a rounded reciprocal would differ from the correctly rounded quotient; the momentum
kernel (interpreted) gives the same codes there.
"""

import pytest
import torch
from torch.nn import functional as F

from leanlm_testing.kernels import device_or_skip
from optim_came import _kernels, _quant

Q, QB = float(_quant.QMAX**2), _quant.QBLOCK
EDGE_ABSMAX = (0.37, 0.11, 5.5)
"""Block absmaxes for which torch's `127² / absmax` (reciprocal, then multiply) is one ulp off
the correctly rounded quotient, so a code at a threshold depends on which one is used."""


def _direct_hash(seed: int, offset: int, numel: int) -> torch.Tensor:
    h = torch.arange(offset, offset + numel, dtype=torch.int64)
    h = (h * 0x9E3779B1 + (seed * 0x85EBCA6B + 0x27D4EB2F)) & 0xFFFFFFFF
    for mul, shift in ((0x85EBCA6B, 16), (0xC2B2AE35, 13)):
        h ^= h >> shift
        h = (h * mul) & 0xFFFFFFFF
    h ^= h >> 16
    return (h >> 8).float() * 2.0**-24


def _direct_quantize(x: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    m = x.shape[-1]
    pad = -m % QB
    xb = F.pad(x, (0, pad)).unflatten(-1, (-1, QB))
    absmax = xb.abs().amax(dim=-1)
    inv = torch.where(absmax > 0, torch.full_like(absmax, Q) / absmax, 0.0).unsqueeze(-1)
    a = (xb.abs() * inv).clamp(max=Q)
    lo = a.sqrt().floor()
    lo = lo - (lo * lo > a).float()
    lo = (lo + ((lo + 1) * (lo + 1) <= a).float()).clamp(0, _quant.QMAX)
    frac = (a - lo * lo) / (2.0 * lo + 1.0)
    up = frac > 0.5 if noise is None else F.pad(noise, (0, pad)).unflatten(-1, (-1, QB)) < frac
    q = (lo + up.float()).clamp(max=_quant.QMAX) * xb.sign()
    return q.flatten(-2)[..., :m].to(torch.int8), absmax


def _edge_values(absmax: float = 3.0) -> torch.Tensor:
    """Rows of 1 + 2·127 elements: the absmax, then values whose `a` is near a threshold/square."""
    k = torch.arange(_quant.QMAX + 1, dtype=torch.float32)
    targets = torch.cat([k * k + k + 0.5, k * k, k * k - 1e-3, k * k + k + 0.5 - 1e-3])
    base = targets * (absmax / Q)  # a = |x| · fl(127² / absmax)
    vals, up, down = [base], base, base
    for _ in range(6):
        up = torch.nextafter(up, torch.tensor(float("inf")))
        down = torch.nextafter(down, torch.tensor(0.0))
        vals += [up, down]
    v = torch.cat(vals).clamp(max=absmax)
    v = v[: v.numel() // 254 * 254].view(-1, 254)
    x = torch.cat([torch.full((v.shape[0], 1), absmax), v], dim=1)
    return torch.cat([x, -x])


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    xs = [_edge_values(), *(_edge_values(a) for a in EDGE_ABSMAX)]
    for shape in [(7, 300), (3, 4, 129), (2, 1), (5, 256)]:
        x = torch.randn(shape, generator=gen) * torch.rand((*shape[:-1], 1), generator=gen) ** 4
        x[..., 0] = 0.0
        x.view(-1)[::17] = -0.0
        xs.append(x)
    tiny = torch.randn(3, 200, generator=gen) * 1e-41  # subnormal absmax
    tiny[1, :7] = 0.0
    return [*xs, tiny]


@pytest.mark.parametrize("sr_seed", [None, 11])
def test_quantize_and_dequantize_equal_the_direct_formula_bit_for_bit(sr_seed) -> None:
    for x in _inputs():
        noise = None
        if sr_seed is not None:
            noise = _direct_hash(sr_seed, 5, x.numel()).view(x.shape)
            assert torch.equal(_quant.hash_uniform(sr_seed, 5, x.shape, x.device), noise)
            out, h = torch.empty_like(x), torch.empty(x.shape, dtype=torch.int32)
            assert torch.equal(
                _quant.hash_uniform(sr_seed, 5, x.shape, x.device, out=out, scratch=h), noise
            )
        want_codes, want_scale = _direct_quantize(x, noise)
        for scratch in (None, torch.empty_like(x)):
            codes = torch.full(x.shape, 99, dtype=torch.int8)
            scale = torch.full(_quant.scale_shape(x.shape), 7.0)
            x_in = x.clone()
            work = {} if scratch is None else {
                "scratch": scratch,
                "signs": torch.empty(x.shape, dtype=torch.bool),
                "sr_scratch": torch.empty_like(x),
            }  # fmt: skip
            _quant.quantize_(x_in, codes, scale, noise=noise, **work)
            assert torch.equal(codes, want_codes)
            assert torch.equal(scale.view(torch.int32), want_scale.view(torch.int32))
            if scratch is None:
                assert torch.equal(x_in.view(torch.int32), x.view(torch.int32))  # left intact
        # dequantize: q·|q| · fl(scale / 127²), with and without workspaces
        c = want_codes.float()
        got = _quant.dequantize(want_codes, want_scale)
        into = _quant.dequantize(
            want_codes, want_scale, out=torch.empty_like(x), scratch=torch.empty_like(x)
        )
        s = (want_scale / Q).repeat_interleave(QB, dim=-1)[..., : x.shape[-1]]
        direct = c * c.abs() * s
        assert torch.equal(got.view(torch.int32), direct.view(torch.int32))
        assert torch.equal(into.view(torch.int32), direct.view(torch.int32))


@pytest.mark.parametrize(
    ("seed", "offset", "numel"), [(3, 2**31 - 9, 40), (2**31 - 2, 2**32 + 3, 300)]
)
def test_hash_wraps_like_the_64_bit_formula(seed, offset, numel) -> None:
    assert torch.equal(_quant.hash_uniform(seed, offset, (numel,), torch.device("cpu")),
                       _direct_hash(seed, offset, numel))  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.parametrize("sr_seed", [None, 7])
def test_the_kernels_encode_gives_the_pytorch_paths_codes_at_the_thresholds(sr_seed) -> None:
    # With m = 0, beta1 = 0 and unit factors the momentum kernel encodes g itself: its codes
    # (div_rn) must equal quantize_'s where `a` sits within ulps of a threshold
    dev = device_or_skip(_kernels)
    g = torch.cat([_edge_values(a) for a in (3.0, *EDGE_ABSMAX)]).to(dev).unsqueeze(0)
    b, n, m = g.shape
    codes = torch.zeros(g.shape, dtype=torch.int8, device=dev)
    scale = torch.zeros(_quant.scale_shape(g.shape), device=dev)
    blocks = -(-n // _kernels.BLOCK_N)
    rowsum, colpart = torch.zeros(b, n, device=dev), torch.zeros(b, blocks, m, device=dev)
    bm, _ = _kernels.launch_config(m, quant=True)
    _kernels._momentum_kernel[(b, blocks)](
        g, codes, torch.ones(b, n, device=dev), torch.ones(b, m, device=dev), rowsum, colpart,
        0.0, n, m, blocks, BLOCK_N=_kernels.BLOCK_N, BLOCK_M=bm, scale_ptr=scale,
        qseed=_kernels.quant_seed(sr_seed), QUANT=True, QSR=sr_seed is not None,
    )  # fmt: skip
    noise = None if sr_seed is None else _quant.hash_uniform(sr_seed, 0, g.shape, dev)
    want_codes, want_scale = torch.empty_like(codes), torch.empty_like(scale)
    _quant.quantize_(g.clone(), want_codes, want_scale, noise=noise)
    assert torch.equal(scale, want_scale)
    assert torch.equal(codes, want_codes)


@pytest.mark.parametrize("sr_seed", [None, 11])
def test_the_quantizer_under_torch_compile_gives_the_same_codes(sr_seed) -> None:
    # `torch.compile(opt.step)` calls `quantize_` / `hash_uniform`; the eager ones write through
    # dtype views of their workspaces, which inductor miscompiled (every sign flipped, or a C++
    # compile error), so they run as custom ops there, which must give the same bits
    import torch._dynamo

    def encode(x, codes, scale, signs, scratch, sr_scratch):
        noise = None
        if sr_seed is not None:
            noise = _quant.hash_uniform(sr_seed, 5, x.shape, x.device)
        _quant.quantize_(x, codes, scale, noise=noise, scratch=scratch, signs=signs,
                         sr_scratch=sr_scratch)  # fmt: skip
        return noise

    torch._dynamo.reset()
    compiled = torch.compile(encode, fullgraph=True, dynamic=False)
    for x in _inputs():
        noise = None if sr_seed is None else _direct_hash(sr_seed, 5, x.numel()).view(x.shape)
        want_codes, want_scale = _direct_quantize(x, noise)
        codes = torch.full(x.shape, 99, dtype=torch.int8)
        scale = torch.full(_quant.scale_shape(x.shape), 7.0)
        work = (torch.empty(x.shape, dtype=torch.bool), torch.empty_like(x), torch.empty_like(x))
        got_noise = compiled(x.clone(), codes, scale, *work)
        if sr_seed is not None:
            assert torch.equal(got_noise, noise)
        assert torch.equal(codes, want_codes)
        assert torch.equal(scale.view(torch.int32), want_scale.view(torch.int32))
