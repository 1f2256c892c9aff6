"""`state_dtype=torch.int8`: the blockwise 8-bit map, the step, state dicts and conversions."""

import copy

import pytest
import torch

from leanlm_testing import bench
from leanlm_testing import optim_basics as basics
from optim_adafactor import factored
from optim_came import CAME, _quant

KW = {"lr": 1e-2, "weight_decay": 0.1}
SHAPES = [(10, 300), (3, 128), (2, 5, 130), (17,)]  # partial block, whole block, 3-D, vector


def _all_values(scale: torch.Tensor) -> torch.Tensor:
    q = torch.arange(-_quant.QMAX, _quant.QMAX + 1, dtype=torch.float32)
    return q * q.abs() / _quant.QMAX**2 * scale.unsqueeze(-1)


@pytest.mark.parametrize("cols", [1, 127, 128, 300])
def test_quantize_is_nearest_and_codes_the_absmax_exactly(cols: int) -> None:
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(cols)) ** 3
    x[2] = 0.0  # an all-zero row: scale 0, codes 0
    codes = torch.empty(x.shape, dtype=torch.int8)
    scale = torch.empty(6, _quant.num_blocks(cols))
    _quant.quantize_(x, codes, scale)
    blocks = _quant._blocked(x)
    torch.testing.assert_close(scale, blocks.abs().amax(dim=-1), atol=0, rtol=0)
    y = _quant.dequantize(codes, scale)
    assert y.shape == x.shape
    assert torch.all(y[2] == 0)
    # brute force over all 255 codes of each element's block
    best = (blocks.unsqueeze(-1) - _all_values(scale).unsqueeze(-2)).abs().amin(dim=-1)
    err = (_quant._blocked(y) - blocks).abs()
    assert torch.all(err <= best + 1e-6 * scale.unsqueeze(-1))  # fp32 rounding at ties
    assert codes.abs().amax() == _quant.QMAX  # every non-zero block's absmax is ±127


def test_stochastic_rounding_is_unbiased_and_the_noise_follows_global_indices() -> None:
    x = torch.randn(4, 200, generator=torch.Generator().manual_seed(1))
    codes = torch.empty(x.shape, dtype=torch.int8)
    scale = torch.empty(4, 2)
    mean = torch.zeros_like(x)
    for seed in range(300):
        _quant.quantize_(x, codes, scale, noise=_quant.hash_uniform(seed, 0, x.shape, x.device))
        mean += _quant.dequantize(codes, scale) / 300
    _quant.quantize_(x, codes, scale)
    nearest_err = (_quant.dequantize(codes, scale) - x).abs().mean()
    assert (mean - x).abs().mean() < nearest_err / 4  # the average of SR converges to x
    whole = _quant.hash_uniform(7, 0, (4, 200), x.device)
    shard = _quant.hash_uniform(7, 2 * 200, (2, 200), x.device)  # rows 2-3 of the same tensor
    assert torch.equal(whole[2:], shard)
    assert 0.45 < whole.mean() < 0.55
    assert whole.min() >= 0
    assert whole.max() < 1


def _params():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).requires_grad_() for s in SHAPES]


def _run(opt, params, seeds):
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def test_state_layout_and_one_step_equals_the_fp32_step_then_quantized() -> None:
    params, ref_params = _params(), _params()
    opt, ref = CAME(params, **KW, state_dtype=torch.int8), CAME(ref_params, **KW)
    _run(opt, params, range(3))
    st = opt.state[params[0]]
    assert st["exp_avg"].dtype == torch.int8
    assert st["exp_avg"].shape == (10, 300)
    assert st["exp_avg_scale"].dtype == torch.float32
    assert st["exp_avg_scale"].shape == (10, 3)
    assert opt.state[params[2]]["exp_avg_scale"].shape == (2, 5, 2)
    assert opt.state[params[3]]["exp_avg"].dtype == torch.float32  # vectors keep fp32
    # the fp32 optimizer from the same state (exp_avg dequantized) steps once; its m_new
    # quantized is the int8 optimizer's new state, and p differs by lr·(m_new - Q(m_new))·factors
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["state_dtype"] = torch.float32
    for state in sd["state"].values():
        if "exp_avg_scale" in state:
            state["exp_avg"] = _quant.dequantize(state["exp_avg"], state.pop("exp_avg_scale"))
    for p, q in zip(params, ref_params, strict=True):
        q.data.copy_(p.data)
    ref.load_state_dict(sd)
    _run(opt, params, [3])
    _run(ref, ref_params, [3])
    for p, q in zip(params, ref_params, strict=True):
        st, ref_st = opt.state[p], ref.state[q]
        if p.dim() >= 2:
            codes = torch.empty_like(st["exp_avg"])
            scale = torch.empty_like(st["exp_avg_scale"])
            _quant.quantize_(ref_st["exp_avg"], codes, scale)
            assert torch.equal(codes, st["exp_avg"])
            assert torch.equal(scale, st["exp_avg_scale"])
            row, col = ref_st["exp_avg_res_row"], ref_st["exp_avg_res_col"]
            factor = torch.rsqrt(row / row.mean(-1, keepdim=True)).unsqueeze(-1)
            factor = factor * torch.rsqrt(col).unsqueeze(-2)
            quant_err = _quant.dequantize(codes, scale) - ref_st["exp_avg"]
            expected = q.detach() - KW["lr"] * quant_err * factor  # p stepped by Q(m_new)
            torch.testing.assert_close(p.detach(), expected, atol=1e-6, rtol=1e-5)
            assert not torch.equal(p, q)
        else:
            assert torch.equal(p, q)
            assert torch.equal(st["exp_avg"], ref_st["exp_avg"])


@pytest.mark.parametrize("sr", [False, True])
def test_row_chunks_step_as_one_sweep(sr: bool, monkeypatch) -> None:
    """The CPU sweeps by chunks of rows: the same codes (the noise of the global elements), up
    to a flip at a rounding boundary where a column sum added in another order moved m."""
    runs = []
    for chunk in (factored.CPU_CHUNK, 300):  # one sweep; one row of (10, 300) per chunk
        monkeypatch.setattr(factored, "CPU_CHUNK", chunk)
        params = _params()
        opt = CAME(params, **KW, state_dtype=torch.int8, stochastic_rounding=sr)
        opt._sr_seed = 5
        _run(opt, params, range(5))
        runs.append((params[0].detach(), opt.state[params[0]]))
    (p, st), (q, chunked) = runs
    assert len(factored.row_chunks(q)) == 10
    diff = (st["exp_avg"].int() - chunked["exp_avg"].int()).abs()
    assert diff.max() <= 1
    assert diff.float().mean() < 1e-2
    torch.testing.assert_close(chunked["exp_avg_scale"], st["exp_avg_scale"], rtol=1e-5, atol=0)
    torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sr", [False, True])
def test_state_dict_round_trip_continues_identically(sr: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).requires_grad_() for s in basics.SHAPES]
    opt = basics.check_round_trip_continues_identically(
        lambda ps: CAME(ps, **KW, state_dtype=torch.int8, stochastic_rounding=sr), params
    )
    assert opt.state[params[0]]["exp_avg"].dtype == torch.int8


def test_stochastic_rounding_changes_the_codes_and_depends_on_the_seed() -> None:
    runs = []
    for sr_seed in (1, 1, 2):
        params = _params()
        opt = CAME(params, **KW, state_dtype=torch.int8, stochastic_rounding=True)
        opt._sr_seed = sr_seed
        _run(opt, params, range(4))
        runs.append(opt.state[params[0]]["exp_avg"])
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_checkpoints_convert_between_state_dtypes() -> None:
    params = _params()
    opt = CAME(params, **KW)
    _run(opt, params, range(3))
    int8 = CAME(basics.clone_leaves(params), **KW, state_dtype=torch.int8)
    sd = opt.state_dict()  # the loaded groups' options win, as in torch: ask for int8 there
    sd["param_groups"][0]["state_dtype"] = torch.int8
    int8.load_state_dict(sd)  # fp32 state -> quantized, not truncated
    for p, q in zip(params, int8.param_groups[0]["params"], strict=True):
        if p.dim() >= 2:
            st = int8.state[q]
            m = _quant.dequantize(st["exp_avg"], st["exp_avg_scale"])
            err = (m - opt.state[p]["exp_avg"]).abs().max()
            assert err <= st["exp_avg_scale"].max() / 127
    back = CAME(basics.clone_leaves(params), **KW)
    sd = int8.state_dict()
    sd["param_groups"][0]["state_dtype"] = torch.float32
    back.load_state_dict(sd)
    for q in back.param_groups[0]["params"]:
        assert back.state[q]["exp_avg"].dtype == torch.float32
        assert "exp_avg_scale" not in back.state[q]
    int8.param_groups[0]["state_dtype"] = torch.bfloat16  # changed in the group: converted
    _run(int8, int8.param_groups[0]["params"], [3])
    for state in int8.state.values():
        assert state["exp_avg"].dtype == torch.bfloat16
        assert "exp_avg_scale" not in state


def test_state_bytes_per_parameter() -> None:
    p = torch.zeros(512, 1024, requires_grad=True)
    opt = CAME([p], lr=1e-3, state_dtype=torch.int8)
    opt.init_state()
    nbytes = sum(t.numel() * t.element_size() for t in opt.state[p].values() if torch.is_tensor(t))
    assert nbytes / p.numel() == pytest.approx(1 + 4 / 128 + 2 * 4 * (512 + 1024) / p.numel())


def test_state_bytes_per_parameter_at_the_tinyllama_shape() -> None:
    # issue 29's target, <= 1.1 state bytes per parameter on a Llama-shaped model, on
    # TinyLlama-1.1B's parameter set (meta tensors: no memory): the int8 first moment, its
    # per-block scales, the factored statistics, and the vectors' full-size fp32 states
    shapes = bench.LlamaShapes(
        hidden=2048, intermediate=5632, layers=22, vocab=32000, kv_hidden=256
    ).shapes()
    per_param = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        params = [torch.empty(s, device="meta", requires_grad=True) for s in shapes]
        opt = CAME(params, lr=1e-3, state_dtype=dtype)
        opt.init_state()
        per_param[dtype] = bench.state_bytes(opt) / sum(p.numel() for p in params)
    assert per_param[torch.int8] <= 1.1, per_param
    assert per_param[torch.int8] > 1 + 4 / 128  # the codes and one fp32 scale per 128
    assert per_param[torch.bfloat16] == pytest.approx(per_param[torch.float32] - 2, abs=1e-3)
