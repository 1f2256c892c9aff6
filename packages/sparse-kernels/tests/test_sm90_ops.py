"""A steady-state `BlockSparseLinear` call on the Hopper path does nothing per call besides its
kernels and the allocation of its outputs (counted by benchmarks/bench_ops.py under the Triton
interpreter; on a GPU every other op would be a kernel launch and a pass over its bytes)."""

from pathlib import Path

import pytest
import torch

from leanlm_testing import assert_verbose_allclose
from leanlm_testing.scripts import script_fixture
from sparse_kernels import _bsr_hopper as H
from sparse_kernels import _bsr_hopper_dw as HW
from sparse_kernels import _bsr_kernels as K
from sparse_kernels import _bsr_plan as P
from sparse_kernels import _bsr_torch as T

bench = script_fixture(
    Path(__file__).resolve().parent.parent / "benchmarks" / "bench_ops.py", "sparse_bench_ops"
)


@pytest.mark.interpreter
def test_sm90_steady_state_call_dispatches_only_its_kernels_and_outputs(bench, monkeypatch):
    """Second fwd+bwd call (plan cached), bf16, dW split in 2: the forward allocates Y and
    launches one kernel; the backward allocates dX, dW and dW's fp32 partials and launches two.
    No sum or cast of the partials after the kernel (the sm_80 path's two extra kernels), no
    zeros, no copy, no `item`; the same bits as the first call."""
    if not (K.HAS_TRITON and K.INTERPRET):
        pytest.skip("counts the interpreter's launches: needs TRITON_INTERPRET=1")
    monkeypatch.setenv(H.ENV, "1")
    layer, x, dy = bench.example(512)
    n_pairs, bm = P.sm90_plan(layer.layout).n_pairs, HW.sm90_dw_config(64, x.dtype)["BLOCK_M"]
    assert HW.sdd_plan(512, n_pairs, bm, None, x.device)[0] == 2  # the split-K path runs
    mode, first, second = bench.steady_call(layer, x, dy)
    assert mode.launches == {
        "forward": ["_bsr_tma_kernel"],
        "backward": ["_bsr_tma_kernel", "_sdd_tma_kernel"],
    }
    assert mode.ops == {
        "forward": ["aten.empty.memory_format"],  # Y
        # dX, dW and dW's fp32 partials
        "backward": [
            "aten.empty.memory_format",
            "aten.empty_like.default",
            "aten.new_empty.default",
        ],
    }
    for a, b in zip(first, second, strict=True):  # deterministic: the same bits again
        assert torch.equal(a, b)
    ref = T.sdd_dense_reference(dy.float(), x.detach().float(), layer.layout)
    assert_verbose_allclose(second[1].float(), ref, atol=4e-2, rtol=1.6e-2, name="dW")
