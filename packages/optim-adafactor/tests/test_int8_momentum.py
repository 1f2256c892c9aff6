"""Adafactor's momentum in 8 bits (`beta1` with `state_dtype=torch.int8`, `optim_adafactor.quant`).

The int8 step is the fp32-state step with the new momentum quantized after it steps the
parameter: checked against that reference on the PyTorch path, the fused kernels (per tensor and
multi-tensor, interpreter) against the PyTorch path at odd shapes, state dicts, option errors and
a small regression that trains as well as with fp32 state.
"""

import copy

import pytest
import torch

from leanlm_testing import kernels as kt
from leanlm_testing import optim_basics as basics
from optim_adafactor import Adafactor, _kernels, quant

KW = {"lr": 1e-2, "relative_step": False, "beta1": 0.9, "weight_decay": 0.01}
SHAPES = [(10, 300), (7,), (2, 5, 130), (33, 128)]


def _params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).requires_grad_() for s in SHAPES]


def _run(opt, params, seeds) -> None:
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * (1 + seed)
        opt.step()


def _seeded(params, **kw) -> Adafactor:
    """Adafactor with a fixed stochastic-rounding seed (drawn from torch's global generator)."""
    torch.manual_seed(0)
    return Adafactor(params, **kw)


def test_options_are_validated() -> None:
    p = [torch.zeros(4, 4, requires_grad=True)]
    with pytest.raises(ValueError, match=r"`beta1` is None.*set `beta1`"):
        Adafactor(p, state_dtype=torch.int8)
    with pytest.raises(TypeError, match=r"`state_dtype` \(torch.float16\)"):
        Adafactor(p, beta1=0.9, state_dtype=torch.float16)
    with pytest.raises(ValueError, match="beta1"):  # torch semantics have no momentum
        Adafactor.from_torch_args(p).add_param_group(
            {"params": [torch.zeros(2, requires_grad=True)], "state_dtype": torch.int8}
        )


def test_state_is_int8_and_steps_as_fp32_then_quantized() -> None:
    """Each step equals the fp32-state step whose new momentum is then quantized."""
    params, ref_params = _params(), _params()
    opt, ref = Adafactor(params, **KW, state_dtype=torch.int8), Adafactor(ref_params, **KW)
    for seed in range(4):
        _run(opt, params, [seed])
        _run(ref, ref_params, [seed])
        for p, q in zip(params, ref_params, strict=True):
            st, ref_st = opt.state[p], ref.state[q]
            assert torch.equal(p, q)  # p steps by the fp32 momentum, before it is quantized
            if p.dim() < 2:  # vectors keep fp32
                assert st["exp_avg"].dtype == torch.float32
                assert torch.equal(st["exp_avg"], ref_st["exp_avg"])
                continue
            codes, scale = st["exp_avg"], st["exp_avg_scale"]
            assert codes.dtype == torch.int8
            assert codes.shape == p.shape
            assert codes.untyped_storage().nbytes() == p.numel()  # one byte per element
            assert scale.dtype == torch.float32
            assert scale.shape == quant.scale_shape(p.shape)
            want_codes, want_scale = torch.empty_like(codes), torch.empty_like(scale)
            quant.quantize_(ref_st["exp_avg"], want_codes, want_scale)
            assert torch.equal(codes, want_codes)
            assert torch.equal(scale, want_scale)
            m = quant.dequantize(codes, scale)
            assert not torch.equal(m, ref_st["exp_avg"])  # quantization changed the values
            assert (m - ref_st["exp_avg"]).abs().max() <= scale.max() / quant.QMAX
            ref_st["exp_avg"].copy_(m)  # the reference continues from the quantized state
    assert opt.state[params[2]]["exp_avg_scale"].shape == (2, 5, 2)


def test_state_bytes_per_parameter() -> None:
    """The state of a 512 x 4096 matrix: 1 B codes + 4 B per 128 scales + factored statistics."""
    p = torch.zeros(512, 4096, requires_grad=True)
    p.grad = torch.randn(p.shape)
    opt = Adafactor([p], **KW, state_dtype=torch.int8)
    opt.step()
    nbytes = sum(t.untyped_storage().nbytes() for t in opt.state[p].values() if torch.is_tensor(t))
    assert nbytes / p.numel() == pytest.approx(1 + 4 / 128 + 4 * (512 + 4096) / p.numel())
    assert nbytes / p.numel() < 1.05  # fp32 momentum: 4.04


def test_round_trips_continue_identically_and_stochastic_codes_follow_the_seed() -> None:
    """`state_dict` -> `load_state_dict` continues bit-exactly with both roundings; stochastic
    codes are a function of the saved seed (equal seeds: equal codes) and differ from nearest."""
    codes = {}
    for sr, sr_seed in ((False, 1), (True, 1), (True, 2)):
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(s, generator=gen).requires_grad_() for s in basics.SHAPES]

        def make(ps, sr=sr, sr_seed=sr_seed) -> Adafactor:
            opt = Adafactor(ps, **KW, state_dtype=torch.int8, stochastic_rounding=sr)
            opt._sr_seed = sr_seed
            return opt

        opt = basics.check_round_trip_continues_identically(make, params)
        codes[sr, sr_seed] = opt.state[params[0]]["exp_avg"]
        assert codes[sr, sr_seed].dtype == torch.int8
    assert not torch.equal(codes[False, 1], codes[True, 1])
    assert not torch.equal(codes[True, 1], codes[True, 2])


def test_checkpoints_convert_between_state_dtypes() -> None:
    """An fp32 momentum loads into an int8 group quantized to nearest; back again dequantized."""
    params = _params()
    fp32 = Adafactor(params, **KW)
    _run(fp32, params, range(3))
    sd = fp32.state_dict()
    sd["param_groups"][0]["state_dtype"] = torch.int8  # the loaded groups' options win
    clones = basics.clone_leaves(params)
    int8 = Adafactor(clones, **KW, state_dtype=torch.int8)
    int8.load_state_dict(sd)
    matrix, clone = params[0], clones[0]
    codes, scale = int8.state[clone]["exp_avg"], int8.state[clone]["exp_avg_scale"]
    want = torch.empty_like(codes)
    quant.quantize_(fp32.state[matrix]["exp_avg"], want, torch.empty_like(scale))
    assert torch.equal(codes, want)
    assert int8.state[clones[1]]["exp_avg"].dtype == torch.float32  # a vector
    int8.param_groups[0]["state_dtype"] = torch.float32  # changed in the group: dequantized
    _run(int8, clones, [3])
    assert all(st["exp_avg"].dtype == torch.float32 for st in int8.state.values())
    assert all("exp_avg_scale" not in st for st in int8.state.values())


FUSED = kt.fused_kernel_marks(_kernels, torch.device("cpu"))
KERNEL_SHAPES = {"odd": (13, 7), "tail_batch": (3, 37, 50), "partial_block": (5, 300),
                 "pow2": (16, 256)}  # fmt: skip


@pytest.mark.parametrize("sr_seed", [None, 1234])
@pytest.mark.parametrize("shape_name", list(KERNEL_SHAPES))
@FUSED[0]
@FUSED[1]
@FUSED[2]
def test_apply_kernel_int8_matches_reference(shape_name, sr_seed) -> None:
    """Decode -> update -> encode in the apply pass: the PyTorch reference's codes, bit for bit."""
    shape = KERNEL_SHAPES[shape_name]
    g, x = torch.randn(shape), torch.randn(shape)
    codes = torch.empty(shape, dtype=torch.int8)
    scale = torch.empty(quant.scale_shape(shape))
    quant.quantize_(x, codes, scale)
    g3, p3 = g.reshape(-1, *shape[-2:]), torch.randn(shape).reshape(-1, *shape[-2:])
    b, n, m = g3.shape
    rs, cf = torch.rand(b, n) * 1e-2, torch.rand(b, m) + 0.5
    decay = torch.full((1,), 1e-3)
    mom, ref_p = quant.dequantize(codes, scale).view(b, n, m), p3.clone()
    _kernels.apply_reference(g3, ref_p, mom, rs, cf, decay, 0.9)
    ref_codes, ref_scale = torch.empty_like(codes), torch.empty_like(scale)
    noise = None if sr_seed is None else quant.hash_uniform(sr_seed, 0, shape, g.device)
    quant.quantize_(mom.view(shape), ref_codes, ref_scale, noise=noise)
    qseed = None if sr_seed is None else quant.quant_seed(sr_seed)
    _kernels.launch_apply(g3, p3, codes.view(b, n, m), rs, cf, decay, 0.9, 0, sr=False,
                          scale=scale, qseed=qseed)  # fmt: skip
    assert torch.equal(scale, ref_scale)
    assert torch.equal(codes, ref_codes)  # the interpreter's fp32 math is the reference's
    assert not torch.equal(quant.dequantize(codes, scale), mom.view(shape))  # really 8 bits
    torch.testing.assert_close(p3, ref_p, atol=1e-6, rtol=1e-6)  # p steps by the fp32 m


FUSED_SHAPES = [(33, 300), (17, 129), (2, 9, 200), (40, 256), (5,)]


@pytest.mark.parametrize("multi_tensor", [False, True])
@pytest.mark.parametrize(("dtype", "sr"), [(torch.float32, False), (torch.bfloat16, True)])
@FUSED[0]
@FUSED[1]
@FUSED[2]
def test_fused_matches_torch_path(dtype, sr, multi_tensor) -> None:
    """Kernels vs PyTorch path, 3 steps at odd widths, per tensor and multi-tensor.

    The statistics' fp32 sums run in another order in the kernels, so the new momentum may
    differ by an ulp and round to the neighbouring code where it lies on a rounding boundary:
    codes within one step of the reference's, almost all equal. The reference continues from
    the fused parameters and state, so the comparison stays per step.
    """
    _check_fused(FUSED_SHAPES, dtype, sr=sr, multi_tensor=multi_tensor)


gpu_tiles = kt.shipped_tiles_fixture([_kernels.__name__, "optim_adafactor._multi_kernels"])


@pytest.mark.parametrize("multi_tensor", [False, True])
@pytest.mark.parametrize("sr", [False, True])
@FUSED[0]
@FUSED[1]
@FUSED[2]
def test_fused_matches_torch_path_at_shipped_tiles(gpu_tiles, sr, multi_tensor) -> None:
    """The GPU's tiles of whole blocks: per tensor 16 x 128 on 8 warps, multi-tensor apply
    8 x 128 (aligned) or 4 x 128 (unaligned), and the GPU's statistics tiles."""
    _check_fused(kt.SHIPPED_TILE_SHAPES, torch.float32, sr=sr, multi_tensor=multi_tensor, steps=2)


def _check_fused(shapes, dtype, *, sr: bool, multi_tensor: bool, steps: int = 3) -> None:
    """Fused (`backend="triton"`) vs PyTorch-path steps; see `test_fused_matches_torch_path`."""
    kw = {**KW, "state_dtype": torch.int8, "stochastic_rounding": sr}
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    fused_params = [p.clone().requires_grad_() for p in init]
    ref_params = [p.float().requires_grad_() for p in init]
    fused = _seeded(fused_params, backend="triton", **kw)
    ref = _seeded(ref_params, backend="torch", **kw)
    fused.multi_tensor = multi_tensor
    for _ in range(steps):
        for a, b in zip(fused_params, ref_params, strict=True):
            g = torch.randn(a.shape, generator=gen) * torch.rand(a.shape[:-1], generator=gen)[
                ..., None
            ].add(0.1)
            a.grad, b.grad = g.to(dtype), g.to(dtype).float()
        fused.step()
        ref.step()
        for a, b in zip(fused_params, ref_params, strict=True):
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(a.detach().float(), b.detach(), rtol=tol, atol=tol * 1e-1)
            st, ref_st = fused.state[a], ref.state[b]
            if a.dim() >= 2:
                codes, ref_codes = st["exp_avg"], ref_st["exp_avg"]
                assert codes.dtype == torch.int8
                diff = (codes.int() - ref_codes.int()).abs()
                assert int(diff.max()) <= 1
                assert float(diff.float().mean()) < 2e-3
                torch.testing.assert_close(st["exp_avg_scale"], ref_st["exp_avg_scale"],
                                           rtol=1e-5, atol=0)  # fmt: skip
            for key, value in st.items():
                if torch.is_tensor(value):
                    ref_st[key].copy_(value)
            b.data.copy_(a.detach().float())
    assert bool(fused._multi_cache) == multi_tensor


def test_int8_regression_tracks_fp32_state() -> None:
    """Least squares with a 64 x 96 weight: the int8-state loss follows the fp32-state loss."""
    gen = torch.Generator().manual_seed(0)
    x, w_true = torch.randn(256, 96, generator=gen), torch.randn(64, 96, generator=gen)
    y = x @ w_true.T
    losses = {}
    for dtype in (torch.float32, torch.int8):
        w = torch.zeros(64, 96, requires_grad=True)
        opt = Adafactor([w], lr=3e-2, relative_step=False, scale_parameter=False, beta1=0.9,
                        state_dtype=dtype)  # fmt: skip
        curve = []
        for _ in range(60):
            loss = (x @ w.T - y).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        losses[dtype] = torch.tensor(curve)
    fp32, int8 = losses[torch.float32], losses[torch.int8]
    assert fp32[-1] < 0.05 * fp32[0]  # it trains
    assert not torch.equal(fp32, int8)  # and the int8 state is not the fp32 one
    assert int8[-1] < 1.25 * fp32[-1]
    torch.testing.assert_close(int8, fp32, rtol=0.1, atol=0.01 * float(fp32[0]))


def test_vectors_and_momentum_enabled_later() -> None:
    """A group switching momentum on later gets int8 state; unfactored tensors keep fp32."""
    params = _params()
    opt = Adafactor(params, lr=1e-2, relative_step=False)
    _run(opt, params, [0])
    assert "exp_avg" not in opt.state[params[0]]
    opt.param_groups[0].update(beta1=0.9, state_dtype=torch.int8)
    _run(opt, params, [1])
    assert opt.state[params[0]]["exp_avg"].dtype == torch.int8
    assert opt.state[params[1]]["exp_avg"].dtype == torch.float32
    sd = copy.deepcopy(opt.state_dict())
    assert sd["state"][0]["exp_avg"].dtype == torch.int8
