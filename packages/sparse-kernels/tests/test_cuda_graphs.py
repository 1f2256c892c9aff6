"""`BlockSparseLinear` inside CUDA graphs: captured once, replayed on new inputs, the same bits
as eager calls (GPU only).

Decode servers replay their step from a CUDA graph, and `benchmarks/bench_sparse.py
--cuda-graphs` times the kernels that way; both need the layer to capture (no host sync, no
host-built tensor after the first call) and every replay to recompute from the static inputs
(the sm_90 dW's split counters reset themselves, the TMA descriptors point at the static
buffers). Warm-up on a side stream, then capture, as torch's CUDA-graph recipe says.
"""

import pytest
import torch

from sparse_kernels import BlockSparseLinear
from sparse_kernels import _bsr_hopper as H

PATHS = ["sm80", "sm90"]


def _layer(monkeypatch: pytest.MonkeyPatch, path: str) -> BlockSparseLinear:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if path == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    monkeypatch.setenv(H.ENV, "1" if path == "sm90" else "0")  # read at every call
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(16, 8, generator=gen) < 0.5  # 1024 -> 2048, block 128: 50% of the tiles
    return BlockSparseLinear(1024, 2048, block_mask=mask, block_size=128, backend="triton",
                             device="cuda", dtype=torch.bfloat16)  # fmt: skip


def _capture(fn, warmup: int = 3):  # type: ignore[no-untyped-def]
    """(graph, static outputs) of `fn`, after `warmup` eager calls on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 512])
@pytest.mark.parametrize("path", PATHS)
def test_forward_replays_like_eager_gpu(monkeypatch, path, tokens):
    layer = _layer(monkeypatch, path)
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return layer(x)

    graph, y = _capture(forward)
    for seed in range(3):  # new inputs in the static buffer: the replay must recompute
        new = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16,
                          generator=torch.Generator("cuda").manual_seed(seed))  # fmt: skip
        x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        eager = forward()
        assert torch.equal(y, eager), f"replay {seed}: max diff {(y - eager).abs().max()}"
        assert y.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_training_step_replays_like_eager_gpu(monkeypatch, path):
    """Forward, dX and dW in one graph; 2048 tokens split the dW sum over programs."""
    layer = _layer(monkeypatch, path)
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)

    def step() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(layer(x), (x, layer.values), dy)

    graph, (dx, dv) = _capture(step)
    for seed in range(3):
        gen = torch.Generator("cuda").manual_seed(seed)
        with torch.no_grad():
            x.copy_(torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=gen))
            dy.copy_(torch.randn(dy.shape, device="cuda", dtype=dy.dtype, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        eager_dx, eager_dv = step()
        assert torch.equal(dx, eager_dx), f"replay {seed}: dX differs"
        assert torch.equal(dv, eager_dv), f"replay {seed}: dW tiles differ"
        assert dv.abs().sum() > 0
