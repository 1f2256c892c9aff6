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

from leanlm_testing.optim_basics import INT8_COMPILE_SHAPES, check_compiled_int8_step
from optim_adafactor import Adafactor, factored, quant

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
    for shape in [*INT8_COMPILE_SHAPES, (1, 1, 300), (1, 100), (1, 127), (1, 129)]:
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
    check_compiled_int8_step(partial(MAKE, stochastic_rounding=sr), dtype)


@pytest.mark.parametrize("sr", [False, True], ids=["nearest", "stochastic"])
def test_compiled_int8_step_matches_eager_on_a_one_row_last_chunk(monkeypatch, sr) -> None:
    """A CPU matrix above `CPU_CHUNK` elements steps in chunks of whole rows: 7 x 300 with a
    chunk of 1000 elements gives chunks of 3, 3 and 1 rows, the last a (1, 300) view.
    Before: the last row's partial-block codes were garbage."""
    monkeypatch.setattr(factored, "CPU_CHUNK", 1000)
    assert factored.row_chunks(torch.empty(7, 300))[-1] == slice(6, 7)
    make = partial(MAKE, stochastic_rounding=sr)
    check_compiled_int8_step(make, torch.float32, [(7, 300)])
