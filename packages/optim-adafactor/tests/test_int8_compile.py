"""`torch.compile(opt.step)` with the int8 momentum: the eager quantizer's codes and noise.

Inductor (torch 2.13, CPU) miscompiled the functional forms that `quant.quantize_` and
`quant.hash_uniform` took under compile on tensors whose leading dimensions are all 1: the
quantizer's partial last block read outside the scales (garbage codes; NaN scales and
parameters in bf16 with stochastic rounding), and the hash of a static (1, 100) tensor gave
other noise and corrupted the heap (an abort in a later malloc). Such a tensor is a one-row
parameter, or the 1-row last chunk of a large matrix on the CPU path (`factored.row_chunks`).
Both now run as custom ops under compile (`optim_adafactor::quantize`,
`optim_adafactor::hash_uniform`), opaque to the compiler.

The steps' own fp32 arithmetic still differs in the last bit (inductor fuses and reorders it),
so a compiled step is compared with the eager one to a few ulps: the codes are the same but
where such an ulp moves a value across a rounding threshold.
"""

from functools import partial

import pytest
import torch

from optim_adafactor import Adafactor, factored, quant

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated"  # inductor imports torch.utils.mkldnn
)

#: one row (or 1-D) with a partial block after full ones; several rows with partial blocks
SHAPES = [(1, 300), (1, 130), (1, 257), (300,), (3, 300)]
MAKE = partial(Adafactor, lr=1e-3, beta1=0.9, relative_step=False, state_dtype=torch.int8)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("sr_seed", [None, 11], ids=["nearest", "stochastic"])
def test_the_compiled_quantizer_gives_the_eager_codes_at_one_row_shapes(dynamic, sr_seed) -> None:
    """Before: (1, 300) 44 codes of 300 wrong, (1, 129) 1 of 1; static (1, 100) 84 noise values."""
    import torch._dynamo

    def encode(x, codes, scale, seed):
        noise = None if sr_seed is None else quant.hash_uniform(seed, 5, x.shape, x.device)
        quant.quantize_(x, codes, scale, noise=noise)
        return noise

    gen = torch.Generator().manual_seed(0)
    for shape in [*SHAPES, (1, 1, 300), (1, 100), (1, 127), (1, 129)]:
        torch._dynamo.reset()  # static: 9 shapes would pass the recompile limit (8)
        compiled = torch.compile(encode, fullgraph=True, dynamic=dynamic)
        x = torch.randn(shape, generator=gen)
        want_codes = torch.empty(shape, dtype=torch.int8)
        want_scale = torch.empty(quant.scale_shape(shape))
        want_noise = encode(x.clone(), want_codes, want_scale, sr_seed)
        codes = torch.full(shape, 99, dtype=torch.int8)
        scale = torch.full(quant.scale_shape(shape), 7.0)
        noise = compiled(x.clone(), codes, scale, sr_seed)
        if sr_seed is not None:
            assert torch.equal(noise, want_noise), shape
        assert torch.equal(codes, want_codes), shape
        assert torch.equal(scale.view(torch.int32), want_scale.view(torch.int32)), shape


def _steps(make_opt, shapes, *, compiled: bool, dtype: torch.dtype, steps: int = 3):
    """Parameters and states after `steps` steps, the number of graphs and of graph breaks."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    torch.manual_seed(0)  # the stochastic-rounding seed is drawn at construction
    opt = make_opt(params)
    step = torch.compile(opt.step) if compiled else opt.step
    for _ in range(steps):  # step 1: a static graph; from step 2 the step count is dynamic
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        step()
    graphs = int(counters["stats"]["unique_graphs"])
    return params, [opt.state[p] for p in params], graphs, sum(counters["graph_break"].values())


def check_compiled_step_matches_eager(make_opt, shapes, dtype: torch.dtype) -> None:
    """Over 3 steps: 3 graphs at most, no graph break, the eager step's int8 state to ulps.

    Codes: equal but for at most one per tensor, by one. Scales: within 1e-6 relative (one fp32
    ulp is 1.2e-7). Parameters: fp32 within 1e-6 (lr 1e-3); bf16 within one bf16 step, at most
    1% of the elements differing.
    """
    eager_p, eager_s, _, _ = _steps(make_opt, shapes, compiled=False, dtype=dtype)
    comp_p, comp_s, graphs, breaks = _steps(make_opt, shapes, compiled=True, dtype=dtype)
    assert 1 <= graphs <= 3, f"{graphs} graphs over 3 steps"
    assert breaks == 0
    for shape, pe, pc, se, sc in zip(shapes, eager_p, comp_p, eager_s, comp_s, strict=True):
        assert not pc.isnan().any(), shape
        if len(shape) >= 2:  # a vector's momentum stays fp32
            assert se["exp_avg"].dtype == sc["exp_avg"].dtype == torch.int8
            off = (sc["exp_avg"].int() - se["exp_avg"].int()).abs()
            assert int((off > 0).sum()) <= 1, (shape, off.nonzero())
            assert int(off.max()) <= 1, (shape, off.nonzero())
            torch.testing.assert_close(sc["exp_avg_scale"], se["exp_avg_scale"], rtol=1e-6, atol=0)
        if dtype == torch.float32:
            torch.testing.assert_close(pc, pe, rtol=0, atol=1e-6)
        else:
            torch.testing.assert_close(pc, pe, rtol=2.0**-7, atol=2.0**-7)
            assert int((pc != pe).sum()) <= 0.01 * pc.numel(), shape


@pytest.mark.parametrize(
    ("dtype", "sr"),
    [
        pytest.param(torch.float32, False, id="fp32"),
        pytest.param(torch.bfloat16, True, id="bf16-sr"),
    ],
)
def test_compiled_int8_step_matches_eager_at_one_row_shapes(dtype, sr) -> None:
    """Before, fp32: the partial blocks' codes were garbage (44 of 300 at (1, 300)); bf16 with
    stochastic rounding: the scales NaN, 256 NaN parameters of 300, or an abort."""
    check_compiled_step_matches_eager(partial(MAKE, stochastic_rounding=sr), SHAPES, dtype)


@pytest.mark.parametrize("sr", [False, True], ids=["nearest", "stochastic"])
def test_compiled_int8_step_matches_eager_on_a_one_row_last_chunk(monkeypatch, sr) -> None:
    """A CPU matrix above `CPU_CHUNK` elements steps in chunks of whole rows: 7 x 300 with a
    chunk of 1000 elements gives chunks of 3, 3 and 1 rows, the last a (1, 300) view.
    Before: the last row's partial-block codes were garbage."""
    monkeypatch.setattr(factored, "CPU_CHUNK", 1000)
    assert factored.row_chunks(torch.empty(7, 300))[-1] == slice(6, 7)
    make = partial(MAKE, stochastic_rounding=sr)
    check_compiled_step_matches_eager(make, [(7, 300)], torch.float32)
