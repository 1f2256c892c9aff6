"""A steady-state `BlockSparseLinear` call on a CUDA device rebuilds nothing and asks the device
nothing (issue 24): no launch plan or config build, no TMA descriptor of the weight, no
torch.cuda query. Counted without a GPU: the layer's tensors are fake CUDA tensors
(`FakeTensorMode`), the device queries are counting stand-ins and the Triton launches are
benchmarks/bench_host.py's stubs (they record their arguments, run nothing)."""

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from leanlm_testing.scripts import script_fixture
from sparse_kernels import BlockSparseLinear
from sparse_kernels import _bsr_hopper as H
from sparse_kernels import _bsr_kernels as K
from sparse_kernels import _bsr_launch as L
from sparse_kernels import _bsr_plan as P
from sparse_kernels.block_sparse import _BlockSparseMM
from sparse_kernels.layout import INDEX_FIELDS, BlockLayout

bench = script_fixture(
    Path(__file__).resolve().parent.parent / "benchmarks" / "bench_host.py", "sparse_bench_host"
)


@pytest.fixture
def device_queries(monkeypatch):
    """Counts of torch.cuda queries, answered as an H100 would; the per-device caches emptied
    before and after (so no fake answer outlives the test)."""
    counts = Counter()
    props = SimpleNamespace(multi_processor_count=132, major=9, minor=0)

    def properties(device=None):
        counts["get_device_properties"] += 1
        return props

    def capability(device=None):
        counts["get_device_capability"] += 1
        return 9, 0

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    L.sm_count.cache_clear()
    L.capability.cache_clear()
    yield counts
    L.sm_count.cache_clear()
    L.capability.cache_clear()


def _count_calls(monkeypatch, counts, module, name, build=None):
    real = getattr(module, name)

    def spy(*args, **kwargs):
        counts[name] += 1
        return (build or real)(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


class _Ctx(SimpleNamespace):
    """What `_BlockSparseMM` uses of autograd's context (autograd's engine cannot run on fake
    CUDA tensors without CUDA, so the test calls the Function's forward and backward)."""

    needs_input_grad = (True, True, False, False, False)

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


@torch.no_grad()  # as autograd runs them
def _fwd_bwd(layer, x, dy):
    ctx = _Ctx()
    _BlockSparseMM.forward(ctx, x, layer.values, layer.bias, layer.layout, "triton")
    return _BlockSparseMM.backward(ctx, dy)


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
@pytest.mark.parametrize("path", ["sm80", "sm90"])
def test_steady_state_call_rebuilds_nothing_and_queries_no_device(
    bench, device_queries, monkeypatch, path
):
    """Two calls (a no_grad forward through the module, then `_BlockSparseMM`'s forward and
    backward) with 512 tokens ("auto" dispatch: an sm_90 device, the Hopper
    kernels' thresholds lowered for "sm90", raised for "sm80"): the first may query and build,
    the second makes no device query, builds no plan, config or weight descriptor, and
    launches the same kernels with the same arguments but the activations and outputs."""
    if not K.HAS_TRITON:
        pytest.skip("the Triton launchers need triton")
    monkeypatch.setenv(H.ENV, "auto")
    monkeypatch.setattr(H, "SM90_MIN_WORK", 0 if path == "sm90" else float("inf"))
    counts = device_queries
    mask = torch.tensor([[1, 1, 1], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)
    layer = BlockSparseLinear(192, 192, block_mask=mask, block_size=64, bias=False,
                              backend="triton", dtype=torch.bfloat16)  # fmt: skip
    plan = P.build_sm90_plan(layer.layout)  # on the host: fake tensors have no values
    from triton.tools.tensor_descriptor import TensorDescriptor

    _count_calls(monkeypatch, counts, L, "kernel_config")
    _count_calls(monkeypatch, counts, K, "kernel_config")
    _count_calls(monkeypatch, counts, TensorDescriptor, "from_tensor")
    mode = FakeTensorMode()
    with mode, bench.stubbed() as stubs:

        def to_cuda(t):  # a fake CUDA tensor like `t` (values never read: launches stubbed)
            return torch.empty(t.shape, dtype=t.dtype, device="cuda")

        fake_plan = P.Sm90Plan(*map(to_cuda, (plan.row_order, plan.col_order, plan.pair_starts,
                                              plan.pair_counts)))  # fmt: skip
        _count_calls(monkeypatch, counts, P, "build_sm90_plan", lambda layout: fake_plan)
        layer._apply(to_cuda)
        x = torch.empty(512, 192, device="cuda", dtype=torch.bfloat16)
        dy = torch.empty(512, 192, device="cuda", dtype=torch.bfloat16)

        def call():
            with torch.no_grad():
                layer(x)  # the module's dispatch (no autograd node under no_grad)
            _fwd_bwd(layer, x, dy)

        call()
        first = {name: stub.last for name, stub in stubs.items() if stub.calls}
        assert counts["get_device_capability"] == 1
        assert counts["get_device_properties"] == 1  # the SM count
        assert counts["build_sm90_plan"] == (path == "sm90")
        counts.clear()
        call()
        launched = {name: stub.calls for name, stub in stubs.items() if stub.calls}
        second = {name: stubs[name].last for name in launched}
    # per call: forward (no_grad), forward, dX, dW
    if path == "sm90":
        assert launched == {"_bsr_tma_kernel": 6, "_sdd_tma_kernel": 2}
    else:
        assert launched == {"_dsd_kernel": 4, "_dsdt_kernel": 2, "_sdd_kernel": 2}
    # steady state: only the activations' descriptors (sm90: A of both forwards and of dX, dY
    # and X of dW)
    assert dict(counts) == ({"from_tensor": 5} if path == "sm90" else {})
    for name in launched:
        (grid0, args0, kw0), (grid1, args1, kw1) = first[name], second[name]
        assert grid0 == grid1
        assert kw0 == kw1
        for a, b in zip(args0, args1, strict=True):
            if isinstance(a, TensorDescriptor):  # the weight's: the same object; else same box
                assert (b is a) if a.base.shape[0] == 9 * 64 else b.block_shape == a.block_shape
            elif not isinstance(a, torch.Tensor):
                assert a == b


def test_plan_build_under_cuda_graph_capture_says_to_warm_up_first(monkeypatch):
    """The one host copy of the sm_90 path (its plan build, first call only) refuses to run
    inside a CUDA graph capture with a message saying what to do (fake CUDA tensors)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    mask = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    layout = BlockLayout.from_block_mask(mask, out_features=128, in_features=128, block_size=64)
    with FakeTensorMode():
        fake = BlockLayout(out_features=128, in_features=128, block_size=64,
                           **{n: torch.empty(getattr(layout, n).shape, dtype=torch.int32,
                                             device="cuda") for n in INDEX_FIELDS})  # fmt: skip
        with pytest.raises(RuntimeError, match="run the layer once"):
            P.sm90_plan(fake)
