# The Triton interpreter on CPU-only machines is chosen by leanlm-testing's pytest plugin.

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def gpu_case():
    """Factory: (layout, values, x, dy) of a seeded 4096 x 4096 block-sparse layer on CUDA.

    `density` is the chance that a tile is kept; values are scaled by 1/64.
    """
    from sparse_kernels.layout import BlockLayout

    def make(tokens: int, block: int, dtype: torch.dtype, density: float = 0.25):
        gen = torch.Generator().manual_seed(0)
        n = k = 4096
        mask = torch.rand(n // block, k // block, generator=gen) < density
        layout = BlockLayout.from_block_mask(mask, out_features=n, in_features=k, block_size=block)
        layout = layout.to(torch.device("cuda"))
        values = (torch.randn(layout.nnzb, block, block, generator=gen) / 64).to("cuda", dtype)
        x = torch.randn(tokens, k, generator=gen).to("cuda", dtype)
        dy = torch.randn(tokens, n, generator=gen).to("cuda", dtype)
        return layout, values, x, dy

    return make


@contextmanager
def _matmul_precision(precision: str) -> Iterator[None]:
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


@pytest.fixture
def matmul_precision():
    """`with matmul_precision("high"): ...`: torch's fp32 matmul precision inside the block."""
    return _matmul_precision


def _assert_fp32_products(x, dy, values, layout, *, roundings, kernels):
    """Y, dX and dW tiles of `kernels` = (dsd, dsdt, sdd) launchers (fp32 inputs, no bias) are
    fp32 sums of exact products: within the worst-case fp32 sum bound (`matmul_error_bound`) of
    the float64 products of the inputs rounded to TF32 by one of `roundings` ("zero" or
    "nearest": TF32 dots), or of the inputs as they are (`None`: IEEE dots)."""
    from leanlm_testing.tf32 import matmul_error_bound, round_to_tf32
    from sparse_kernels.layout import blocks_to_dense, dense_to_blocks

    dsd, dsdt, sdd = kernels
    M, Kf, N = x.shape[0], layout.in_features, layout.out_features
    got = {"Y": dsd(x, values, layout, None), "dX": dsdt(dy, values, layout)}
    got["dW"] = blocks_to_dense(sdd(dy, x, layout, values), layout)  # dense: 0 elsewhere
    worst = {}
    for rounding in roundings:
        rx, rdy, rv = (t if rounding is None else round_to_tf32(t, rounding=rounding)
                       for t in (x, dy, values))  # fmt: skip
        w = blocks_to_dense(rv, layout)
        # (operands, reduction terms): dW adds up to 16 split partials
        ops = {"Y": (rx, w.T, Kf), "dX": (rdy, w, N), "dW": (rdy.T, rx, M + 16)}
        ratios = {}
        for name, (a, b, terms) in ops.items():
            ref = a.double() @ b.double()
            if name == "dW":
                ref = blocks_to_dense(dense_to_blocks(ref, layout), layout)
            err = (got[name].double() - ref).abs()
            ratios[name] = (err / matmul_error_bound(a, b, terms=terms).clamp_min(1e-300)).max()
        worst[rounding] = {k: float(v) for k, v in ratios.items()}
        if max(ratios.values()) <= 1:
            return
    raise AssertionError(
        f"results beyond the fp32 sum bound of the products of the inputs rounded by "
        f"{roundings} (None: not rounded; max error / bound): {worst}"
    )


@pytest.fixture
def assert_fp32_products():
    """`assert_fp32_products(x, dy, values, layout, *, roundings, kernels)`: the TF32 (rounded
    inputs) or IEEE (`None`: inputs as they are) check of fp32 kernels, shared by the sm_80
    tests (test_block_sparse.py) and the sm_90 ones (test_sm90.py)."""
    return _assert_fp32_products
