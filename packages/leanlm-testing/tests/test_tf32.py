import os

import pytest
import torch

from leanlm_testing.tf32 import interpreted_tf32_dots, matmul_error_bound, round_to_tf32

ULP = 2.0**-10  # TF32 ulp at 1.0


def test_round_to_tf32_hand_cases():
    x = torch.tensor([1 + ULP / 2, 1 + 3 * ULP / 2, 1 + ULP / 2 + 2**-20, -(1 + ULP / 2 + 2**-20),
                      1 + ULP - 2**-23, 0.0, float("inf"), -float("inf")])  # fmt: skip
    nearest = [1.0, 1 + 2 * ULP, 1 + ULP, -(1 + ULP), 1 + ULP, 0.0, float("inf"), -float("inf")]
    zero = [1.0, 1 + ULP, 1.0, -1.0, 1.0, 0.0, float("inf"), -float("inf")]
    assert round_to_tf32(x).tolist() == nearest  # ties (first two) go to the even mantissa
    assert round_to_tf32(x, rounding="zero").tolist() == zero
    assert round_to_tf32(torch.tensor([float("nan")])).isnan().all()
    # past the largest TF32 value (2 - 2^-10) * 2^127, rounding to nearest overflows to inf
    assert round_to_tf32(torch.tensor([torch.finfo(torch.float32).max])).isinf().all()
    with pytest.raises(TypeError, match="float32"):
        round_to_tf32(torch.ones(2, dtype=torch.float64))


def test_round_to_tf32_matches_frexp_rounding_on_random_values():
    x = torch.randn(100_000) * torch.logspace(-30, 30, 100_000)
    m, e = torch.frexp(x.double())  # x = m * 2^e, 0.5 <= |m| < 1: 11 significant bits kept
    for rounding, op in (("nearest", torch.round), ("zero", torch.trunc)):  # round: half to even
        expected = torch.ldexp(op(m * 2**11) / 2**11, e.double()).float()
        assert torch.equal(round_to_tf32(x, rounding=rounding), expected)
    assert ((round_to_tf32(x) - x).abs() <= x.abs() * 2**-11).all()


def test_matmul_error_bound_covers_a_truncating_fp32_sum_and_is_not_vacuous():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 300, generator=gen), torch.randn(300, 6, generator=gen)
    exact = a.double() @ b.double()
    acc = torch.zeros(8, 6)
    for k in range(300):  # an fp32 adder rounding toward zero, one product at a time
        s = acc.double() + a[:, k : k + 1].double() * b[k : k + 1, :].double()
        t = s.float()
        acc = torch.where(t.double().abs() > s.abs(), torch.nextafter(t, torch.zeros(())), t)
    bound = matmul_error_bound(a, b, terms=300)
    err = (acc.double() - exact).abs()
    assert (err <= bound).all()
    assert err.max() > bound.max() / 100  # the bound is within two orders of the error
    with pytest.raises(ValueError, match="terms"):
        matmul_error_bound(a, b, terms=2**23)


@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
def test_interpreted_tf32_dots_round_tf32_operands_and_record_each_precision():
    triton = pytest.importorskip("triton")
    tl = triton.language

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, c_ptr, PRECISION: tl.constexpr):  # noqa: N803 (Triton style)
        offs = tl.arange(0, 16)
        a = tl.load(a_ptr + offs[:, None] * 16 + offs[None, :])
        b = tl.load(b_ptr + offs[:, None] * 16 + offs[None, :])
        c = tl.dot(a, b, input_precision=PRECISION)
        tl.store(c_ptr + offs[:, None] * 16 + offs[None, :], c)

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 16, generator=gen), torch.randn(16, 16, generator=gen)
    exact = a.double() @ b.double()
    cut_a, cut_b = (round_to_tf32(t, rounding="zero").double() for t in (a, b))
    rounded = cut_a @ cut_b
    out = {p: torch.empty(16, 16) for p in ("ieee", "tf32")}
    with interpreted_tf32_dots() as seen:
        for precision, c in out.items():
            dot_kernel[(1,)](a, b, c, PRECISION=precision)
    assert seen == ["ieee", "tf32"]
    bound = matmul_error_bound(a, b, terms=16)
    assert ((out["ieee"].double() - exact).abs() <= bound).all()
    assert ((out["tf32"].double() - rounded).abs() <= bound).all()
    assert (out["tf32"].double() - exact).abs().max() > 10 * bound.max()  # it did round
    dot_kernel[(1,)](a, b, out["tf32"], PRECISION="tf32")  # outside the block: exact again
    assert ((out["tf32"].double() - exact).abs() <= bound).all()
