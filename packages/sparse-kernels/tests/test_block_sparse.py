"""Block-sparse kernels (Triton and PyTorch paths) vs the dense reference, and BlockSparseLinear.

Tolerances (vs an fp32 dense product of the same, already-rounded inputs): fp32 paths sum in
a different order, (atol, rtol) = (1e-5, 1e-5); outputs rounded to fp16 / bf16 are within one or
two ulps: fp16 (2e-3, 2e-3), bf16 (1e-2, 1.6e-2) (the interpreter truncates fp32 -> bf16).
fp32 under matmul precision "high"/"medium" (TF32 dots): against the float64 product of the
TF32-rounded inputs, within the worst-case bound of an fp32 sum (`matmul_error_bound`; the
`assert_fp32_products` fixture of conftest.py, shared with test_sm90.py).
"""

import pytest
import torch
from torch import nn

from leanlm_testing import assert_verbose_allclose
from leanlm_testing.tf32 import interpreted_tf32_dots
from sparse_kernels import BlockSparseLinear
from sparse_kernels import _bsr_kernels as K
from sparse_kernels import _bsr_torch as T
from sparse_kernels._bsr_launch import kernel_config
from sparse_kernels.block_sparse import block_sparse_linear
from sparse_kernels.layout import BlockLayout, blocks_to_dense, dense_to_blocks

# name: (tokens M, out N, in K, block b, tile density)
SHAPES = {
    "pow2": (64, 64, 128, 32, 0.5),
    "odd": (37, 45, 51, 16, 0.6),
    "tail_heavy": (33, 17, 70, 16, 0.7),
    "tiny": (1, 3, 5, 16, 1.0),
}
SM80 = (K.dsd_triton, K.dsdt_triton, K.sdd_triton)  # launchers for `assert_fp32_products`
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}


def _case(name, dtype, device="cpu", seed=0):
    M, N, Kf, b, density = SHAPES[name]
    gen = torch.Generator().manual_seed(seed)
    rb, cb = -(-N // b), -(-Kf // b)
    mask = torch.rand(rb, cb, generator=gen) < density
    mask.view(-1)[0] = True  # at least one tile
    layout = BlockLayout.from_block_mask(mask, out_features=N, in_features=Kf, block_size=b)
    dense = torch.randn(N, Kf, generator=gen)
    values = dense_to_blocks(dense, layout).to(device, dtype)
    x = torch.randn(M, Kf, generator=gen).to(device, dtype)
    dy = torch.randn(M, N, generator=gen).to(device, dtype)
    bias = torch.randn(N, generator=gen).to(device, dtype)
    return layout.to(torch.device(device)), values, x, dy, bias


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _skip_without_triton():
    if not K.available(torch.device(_device())):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")


def _skip_unless_interpreter():
    if not (K.INTERPRET and K.HAS_TRITON):
        pytest.skip("records the dots' precision through the Triton interpreter")


def test_layout_indexes_both_ways():
    mask = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 0]], dtype=torch.bool)
    layout = BlockLayout.from_block_mask(mask, out_features=40, in_features=33, block_size=16)
    assert layout.row_ptr.tolist() == [0, 2, 2, 4]
    assert layout.col_idx.tolist() == [0, 2, 0, 1]
    assert layout.col_ptr.tolist() == [0, 2, 3, 4]
    assert layout.t_perm.tolist() == [0, 2, 3, 1]
    assert torch.equal(layout.block_mask(), mask)
    w = torch.randn(40, 33)
    tiles = dense_to_blocks(w, layout)
    back = blocks_to_dense(tiles, layout)
    full = mask.repeat_interleave(16, 0).repeat_interleave(16, 1)[:40, :33]
    assert torch.equal(back, w * full)
    with pytest.raises(ValueError, match="block_mask"):
        BlockLayout.from_block_mask(mask, out_features=64, in_features=33, block_size=16)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(SHAPES))
def test_triton_kernels_match_dense_reference(name, dtype):
    _skip_without_triton()
    layout, values, x, dy, bias = _case(name, dtype, _device())
    atol, rtol = TOL[dtype]
    y = K.dsd_triton(x, values, layout, bias)
    assert y.dtype == dtype
    ref = T.dsd_dense_reference(x, values, layout, bias)
    assert_verbose_allclose(y, ref, atol=atol, rtol=rtol, name="Y")
    dx = K.dsdt_triton(dy, values, layout)
    ref = T.dsdt_dense_reference(dy, values, layout)
    assert_verbose_allclose(dx, ref, atol=atol, rtol=rtol, name="dX")
    dv = K.sdd_triton(dy, x, layout, values)
    ref = T.sdd_dense_reference(dy, x, layout)
    assert_verbose_allclose(dv, ref, atol=atol, rtol=rtol, name="dW tiles")


@pytest.mark.parametrize("route", ["sparse", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SHAPES))
def test_torch_path_matches_dense_reference(name, dtype, route):
    layout, values, x, dy, bias = _case(name, dtype)
    atol, rtol = TOL[dtype]
    cross = 1.0 if route == "sparse" else 0.0  # force the BSR/tile route or the dense GEMM
    assert_verbose_allclose(
        T.dsd_torch(x, values, layout, bias, dense_crossover=cross),
        T.dsd_dense_reference(x, values, layout, bias),
        atol=atol, rtol=rtol, name="Y",
    )  # fmt: skip
    assert_verbose_allclose(
        T.dsdt_torch(dy, values, layout, dense_crossover=cross),
        T.dsdt_dense_reference(dy, values, layout),
        atol=atol, rtol=rtol, name="dX",
    )  # fmt: skip
    assert_verbose_allclose(
        T.sdd_torch(dy, x, layout, dense_crossover=cross),
        T.sdd_dense_reference(dy, x, layout),
        atol=atol, rtol=rtol, name="dW tiles",
    )  # fmt: skip


def _check_module_against_dense(layer: BlockSparseLinear, x: torch.Tensor, atol, rtol):
    dense = layer.to_dense().detach().clone().requires_grad_(True)
    bias = layer.bias.detach().clone().requires_grad_(True)
    x1 = x.clone().requires_grad_(True)
    x2 = x.clone().requires_grad_(True)
    y = layer(x1)
    ref = torch.nn.functional.linear(x2.float(), dense.float(), bias.float())
    assert y.shape == ref.shape
    assert_verbose_allclose(y, ref, atol=atol, rtol=rtol, name="forward")
    g = torch.randn_like(ref)
    y.backward(g.to(y.dtype))
    ref.backward(g)
    assert_verbose_allclose(x1.grad, x2.grad, atol=atol, rtol=rtol, name="dX")
    tiles = dense_to_blocks(dense.grad, layer.layout)
    assert_verbose_allclose(layer.values.grad, tiles, atol=atol, rtol=rtol, name="dW")
    assert_verbose_allclose(layer.bias.grad, bias.grad, atol=atol, rtol=rtol, name="db")


@pytest.mark.parametrize(
    "backend",
    ["torch", pytest.param("triton", marks=pytest.mark.interpreter)],
)
@pytest.mark.parametrize("name", ["odd", "tail_heavy"])
def test_block_sparse_linear_autograd_matches_dense(name, backend):
    if backend == "triton":
        _skip_without_triton()
    M, N, Kf, b, _ = SHAPES[name]
    linear = nn.Linear(Kf, N)
    layer = BlockSparseLinear.from_dense(linear, block_size=b, sparsity=0.5, backend=backend)
    x = torch.randn(3, M // 3 + 1, Kf)  # leading dims are kept
    _check_module_against_dense(layer, x, 1e-5, 1e-5)


def test_from_dense_keeps_the_largest_tiles_and_bias():
    linear = nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight[:16, :16] *= 100  # tile (0, 0) must survive
    layer = BlockSparseLinear.from_dense(linear, block_size=16, sparsity=0.75, backend="torch")
    mask = layer.layout.block_mask()
    assert int(mask.sum()) == 12 - round(0.75 * 12)
    assert bool(mask[0, 0])
    full = mask.repeat_interleave(16, 0).repeat_interleave(16, 1)
    assert torch.equal(layer.to_dense(), linear.weight.detach() * full)
    x = torch.randn(5, 64)
    expected = torch.nn.functional.linear(x, linear.weight * full, linear.bias)
    assert_verbose_allclose(layer(x), expected, atol=1e-5, rtol=1e-5, name="y")
    assert_verbose_allclose(layer.to_linear()(x), expected, atol=1e-5, rtol=1e-5, name="y")
    assert "density=0.250" in repr(layer)


def test_training_keeps_the_block_structure_and_state_dict_round_trips():
    linear = nn.Linear(50, 40)
    layer = BlockSparseLinear.from_dense(linear, block_size=16, sparsity=0.5, backend="torch")
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.1)
    mask = layer.layout.block_mask()
    full = mask.repeat_interleave(16, 0).repeat_interleave(16, 1)[:40, :50]
    for _ in range(3):
        loss = layer(torch.randn(8, 50)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    w = layer.to_dense().detach()
    assert (w[~full] == 0).all()
    # padding of the edge tiles stays zero too
    assert torch.equal(dense_to_blocks(w, layer.layout), layer.values.detach())
    clone = BlockSparseLinear(50, 40, block_mask=mask, block_size=16, backend="torch")
    clone.load_state_dict(layer.state_dict())
    x = torch.randn(4, 50)
    assert torch.equal(clone(x), layer(x))


@pytest.mark.interpreter
@pytest.mark.parametrize("block", [64, 128])
def test_triton_kernels_at_gpu_tiles_fp32(block):
    """The GPU launch configs (BLOCK_M 64, BK chunks of a tile, 32/64-token dW steps, token
    splits) under the interpreter: odd widths (padded to 16), a token tail, few programs."""
    _skip_without_triton()
    dev = _device()
    gen = torch.Generator().manual_seed(1)
    M, N, Kf = 100, 2 * block + 5, 2 * block + 3
    mask = torch.tensor([[1, 0, 1], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    layout = BlockLayout.from_block_mask(mask, out_features=N, in_features=Kf, block_size=block)
    layout = layout.to(torch.device(dev))
    values = dense_to_blocks(torch.randn(N, Kf, generator=gen), layout.to(torch.device("cpu")))
    values = values.to(dev)
    x = torch.randn(M, Kf, generator=gen).to(dev)
    dy = torch.randn(M, N, generator=gen).to(dev)
    bias = torch.randn(N, generator=gen).to(dev)
    atol, rtol = 1e-4, 1e-5  # fp32, sums of up to 2·block products of unit-variance terms
    cfg = {k: kernel_config(k, block, torch.float32) for k in ("dsd", "dsdt", "sdd")}
    assert cfg["dsd"]["BLOCK_M"] == 64
    assert cfg["dsd"]["BK"] < block  # the tile is reduced in chunks
    y = K.dsd_triton(x, values, layout, bias, config=cfg["dsd"])
    assert_verbose_allclose(
        y, T.dsd_dense_reference(x, values, layout, bias), atol=atol, rtol=rtol, name="Y"
    )
    dx = K.dsdt_triton(dy, values, layout, config=cfg["dsdt"])
    assert_verbose_allclose(
        dx, T.dsdt_dense_reference(dy, values, layout), atol=atol, rtol=rtol, name="dX"
    )
    ref = T.sdd_dense_reference(dy, x, layout)
    for splits in (1, 2):  # 2: two token ranges, fp32 partials summed by the launcher
        dv = K.sdd_triton(dy, x, layout, values, config=cfg["sdd"], splits=splits)
        assert_verbose_allclose(dv, ref, atol=atol, rtol=rtol, name=f"dW tiles, {splits} split")


@pytest.mark.interpreter
@pytest.mark.parametrize(
    ("precision", "fp32_dots"), [("highest", "ieee"), ("high", "tf32"), ("medium", "tf32")]
)
def test_launchers_pass_the_matmul_precision_to_the_dots(precision, fp32_dots, matmul_precision):
    """The precision each launched dot received (recorded by the interpreter), per setting."""
    _skip_unless_interpreter()
    for dtype, expected in ((torch.float32, fp32_dots), (torch.bfloat16, "tf32")):
        layout, values, x, dy, bias = _case("tiny", dtype, _device())
        with matmul_precision(precision), interpreted_tf32_dots() as seen:
            K.dsd_triton(x, values, layout, bias)
            K.dsdt_triton(dy, values, layout)
            K.sdd_triton(dy, x, layout, values)
        assert len(seen) == 3  # one tile, one token tile: one dot per kernel
        assert set(seen) == {expected}, (dtype, seen)


@pytest.mark.interpreter
@pytest.mark.parametrize("precision", ["highest", "high"])
def test_fp32_kernels_follow_the_matmul_precision(
    precision, matmul_precision, assert_fp32_products
):
    """ "highest": IEEE fp32 (the fp32 tolerance); "high": TF32 dots (rounded operands, here
    emulated in the interpreter as the tensor cores do), checked against the TF32 model."""
    _skip_unless_interpreter()
    layout, values, x, dy, _ = _case("pow2", torch.float32, _device())
    with matmul_precision(precision), interpreted_tf32_dots(rounding="zero"):
        if precision == "high":
            assert_fp32_products(x, dy, values, layout, roundings=("zero",), kernels=SM80)
            return
        atol, rtol = TOL[torch.float32]
        y = K.dsd_triton(x, values, layout, None)
        assert_verbose_allclose(y, T.dsd_dense_reference(x, values, layout, None), atol=atol,
                                rtol=rtol, name="Y")  # fmt: skip
        dx = K.dsdt_triton(dy, values, layout)
        assert_verbose_allclose(dx, T.dsdt_dense_reference(dy, values, layout), atol=atol,
                                rtol=rtol, name="dX")  # fmt: skip
        dv = K.sdd_triton(dy, x, layout, values)
        assert_verbose_allclose(dv, T.sdd_dense_reference(dy, x, layout), atol=atol, rtol=rtol,
                                name="dW tiles")  # fmt: skip


def test_backend_validation():
    linear = nn.Linear(32, 32)
    with pytest.raises(ValueError, match="backend"):
        BlockSparseLinear.from_dense(linear, block_size=16, backend="cuda")  # type: ignore[arg-type]
    layer = BlockSparseLinear.from_dense(linear, block_size=8, sparsity=0.5, backend="triton")
    with pytest.raises(ValueError, match="block_size"):
        layer(torch.randn(2, 32))
    layout, values, x, _, _ = _case("odd", torch.float32)
    if K.HAS_TRITON:
        with pytest.raises(TypeError, match="dtype"):
            K.dsd_triton(x.double(), values, layout, None)
        with pytest.raises(ValueError, match="features"):
            K.dsd_triton(x[:, :-1], values, layout, None)
    y = block_sparse_linear(x.reshape(1, *x.shape), values, layout, backend="torch")
    assert y.shape == (1, x.shape[0], layout.out_features)
    # auto on CPU picks the PyTorch path even under the interpreter
    auto = BlockSparseLinear.from_dense(linear, block_size=16, sparsity=0.5)
    assert_verbose_allclose(
        auto(torch.ones(1, 32)),
        auto.to_linear()(torch.ones(1, 32)),
        atol=1e-5, rtol=1e-5,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("tokens", [1, 2048])
def test_triton_kernels_real_sizes_gpu(tokens, block, dtype, gpu_case, matmul_precision):
    """fp32 at torch's default matmul precision "highest": IEEE dots, fp32 reference."""
    with matmul_precision("highest"):
        _check_real_sizes_gpu(*gpu_case(tokens, block, dtype), dtype)


def _check_real_sizes_gpu(layout, values, x, dy, dtype):
    # fp32 accumulation over up to 4096 products of bf16/fp16 inputs; fp32 inputs are exact
    # (IEEE dots) and keep the fp16 tolerance (the reference sums in another order)
    atol, rtol = (2e-2, 2e-2) if dtype == torch.bfloat16 else (5e-3, 5e-3)
    assert_verbose_allclose(
        K.dsd_triton(x, values, layout, None),
        T.dsd_dense_reference(x, values, layout, None),
        atol=atol, rtol=rtol, name="Y",
    )  # fmt: skip
    assert_verbose_allclose(
        K.dsdt_triton(dy, values, layout),
        T.dsdt_dense_reference(dy, values, layout),
        atol=atol, rtol=rtol, name="dX",
    )  # fmt: skip
    assert_verbose_allclose(
        K.sdd_triton(dy, x, layout, values),
        T.sdd_dense_reference(dy, x, layout),
        atol=atol * 8, rtol=rtol, name="dW tiles",
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("tokens", [1, 2048])
def test_triton_kernels_tf32_real_sizes_gpu(
    tokens, block, gpu_case, matmul_precision, assert_fp32_products
):
    """fp32 at matmul precision "high": TF32 dots, against the float64 product of the operands
    rounded to TF32 (to nearest, or cut as Triton's unconverted operands may be)."""
    layout, values, x, dy = gpu_case(tokens, block, torch.float32)
    with matmul_precision("high"):
        assert_fp32_products(x, dy, values, layout, roundings=("zero", "nearest"), kernels=SM80)


def test_to_block_sparse_replaces_masked_linears_with_same_outputs():
    from leanlm_testing.models import random_batches, tiny_llama
    from sparse_kernels import SparsityConfig, sparsify_
    from sparse_kernels.convert import to_block_sparse_

    model = tiny_llama()
    batch = random_batches(256, batches=1)[0]
    sparsify_(model, SparsityConfig(pattern="block", sparsity=0.75, block_size=16))
    expected = model(**batch).logits
    new = to_block_sparse_(model, block_size=16, backend="torch")
    assert len(new) == 14
    assert isinstance(model.model.layers[0].mlp.up_proj, BlockSparseLinear)
    assert_verbose_allclose(model(**batch).logits, expected, atol=1e-5, rtol=1e-5, name="logits")
    assert all(abs(m.density - 0.25) < 0.02 for m in new.values())
    # trains end to end
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    opt.step()
    # a non-block mask is refused; an explicit sparsity works without masks
    other = tiny_llama()
    sparsify_(other, SparsityConfig(pattern="2:4"))
    with pytest.raises(ValueError, match="whole 16x16 tiles"):
        to_block_sparse_(other, block_size=16)
    plain = tiny_llama()
    with pytest.raises(ValueError, match="no mask"):
        to_block_sparse_(plain, block_size=16)
    to_block_sparse_(plain, block_size=16, sparsity=0.5, targets=[r"mlp\."])
    assert isinstance(plain.model.layers[1].mlp.down_proj, BlockSparseLinear)
