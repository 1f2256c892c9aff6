"""2:4 compression: exact round trip, CUTLASS metadata layout interop, size, validation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.sparse._semi_structured_conversions import (
    sparse_semi_structured_from_dense_cutlass,
    sparse_semi_structured_to_dense_cutlass,
)

from sparse_kernels import nm_mask
from sparse_kernels.semi24 import compress_24, decompress_24, is_24, to_semi_structured_


def _random_24(rows, cols, dtype=torch.float32, seed=0, exact_two=False):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen)
    w = w * nm_mask(w.abs(), 2, 4)
    if not exact_two:  # also groups with 0 or 1 non-zero
        w = w * (torch.rand(rows, cols, generator=gen) > 0.3)
    else:
        w = torch.where(w == 0, w, w.sign() * (w.abs() + 0.1))
    return w.to(dtype)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 33),
    groups=st.integers(1, 20),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_is_exact(rows, groups, dtype, seed):
    w = _random_24(rows, 4 * groups, dtype, seed)
    values, meta = compress_24(w)
    assert values.shape == (rows, 2 * groups)
    assert meta.shape == (rows, -(-groups // 4))
    assert meta.dtype == torch.int16
    back = decompress_24(values, meta, 4 * groups)
    assert torch.equal(back, w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(32, 32), (64, 128), (96, 96)])
def test_cutlass_layout_matches_torch(shape, dtype):
    w = _random_24(*shape, dtype=dtype, exact_two=True)
    values, meta = compress_24(w, layout="cutlass")
    t_values, t_meta = sparse_semi_structured_from_dense_cutlass(w)
    assert torch.equal(values, t_values)
    assert torch.equal(meta, t_meta)
    # with padding positions (groups of < 2 non-zeros) torch still decodes ours exactly
    w2 = _random_24(*shape, dtype=dtype, seed=1)
    v2, m2 = compress_24(w2, layout="cutlass")
    assert torch.equal(sparse_semi_structured_to_dense_cutlass(v2, m2), w2)
    assert torch.equal(decompress_24(v2, m2, shape[1], layout="cutlass"), w2)
    # ... and we decode torch's encoding of them (which differs from ours: other padding)
    t_v2, t_m2 = sparse_semi_structured_from_dense_cutlass(w2)
    assert torch.equal(decompress_24(t_v2, t_m2, shape[1], layout="cutlass"), w2)
    assert not torch.equal(m2, t_m2)


def test_compressed_size_is_56_percent_for_half():
    w = _random_24(64, 128, torch.float16)
    values, meta = compress_24(w)
    ratio = (values.numel() * 2 + meta.numel() * 2) / (w.numel() * 2)
    assert ratio == pytest.approx(0.5625)


def test_validation():
    with pytest.raises(ValueError, match="not 2:4"):
        compress_24(torch.ones(2, 8))
    with pytest.raises(ValueError, match="multiple of 4"):
        compress_24(torch.zeros(2, 6))
    with pytest.raises(ValueError, match="cutlass"):
        compress_24(torch.zeros(32, 32), layout="cutlass")  # fp32
    with pytest.raises(ValueError, match="rows % 32"):
        compress_24(torch.zeros(8, 32, dtype=torch.float16), layout="cutlass")
    assert is_24(_random_24(4, 8))
    assert not is_24(torch.ones(4, 8))
    with pytest.raises(ValueError, match="CUDA-only"):
        to_semi_structured_(torch.nn.Linear(16, 32))


@pytest.mark.gpu
def test_semi_structured_dispatch_matches_dense_gpu():
    lin = torch.nn.Linear(256, 128).half().cuda()
    with torch.no_grad():
        lin.weight.mul_(nm_mask(lin.weight.abs(), 2, 4))
    x = torch.randn(64, 256, dtype=torch.half, device="cuda")
    ref = lin(x)
    to_semi_structured_(lin)
    torch.testing.assert_close(lin(x), ref, atol=2e-2, rtol=2e-2)


SHAPES_24 = {"pow2": (32, 64), "odd": (5, 12), "tail_heavy": (33, 84), "tiny": (1, 4)}


def _skip_without_triton():
    from sparse_kernels import _semi24_kernels

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not _semi24_kernels.available(dev):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    return dev


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(SHAPES_24))
def test_triton_compress_decompress_bitwise_equal_reference(name, dtype):
    # tolerance (0, 0): the kernels only select and move values
    dev = _skip_without_triton()
    rows, cols = SHAPES_24[name]
    w = _random_24(rows, cols, dtype, seed=rows * cols).to(dev)
    values, meta = compress_24(w, backend="triton")
    ref_values, ref_meta = compress_24(w, backend="torch")
    assert torch.equal(values, ref_values)
    assert torch.equal(meta, ref_meta)
    assert torch.equal(decompress_24(values, meta, cols, backend="triton"), w)
    if rows % 32 == 0 and cols % 32 == 0 and dtype != torch.float32:
        v2, m2 = compress_24(w, layout="cutlass", backend="triton")
        assert torch.equal(m2, compress_24(w, layout="cutlass", backend="torch")[1])
        assert torch.equal(decompress_24(v2, m2, cols, layout="cutlass", backend="triton"), w)


def test_backend_validation_24():
    with pytest.raises(ValueError, match="backend"):
        compress_24(torch.zeros(4, 8), backend="cuda")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_compress_real_size_gpu(dtype):
    w = _random_24(4096, 4096, dtype).cuda()
    values, meta = compress_24(w, backend="triton")
    ref_values, ref_meta = compress_24(w, backend="torch")
    assert torch.equal(values, ref_values)
    assert torch.equal(meta, ref_meta)
    assert torch.equal(decompress_24(values, meta, 4096, backend="triton"), w)
