"""The multi-tensor work split (`_multi_tables`) and the launch plan read from the step.

The plan must be what the step launches: the same kernels with the same grids as a real
interpreter step (recorded by `count_launches`), and its elements must cover every element of
every matrix exactly once. Groups (a batch split to bound the scratch) must step exactly as one
launch set does. At the GPU's sizes a row item holds the most whole row tiles within 64K
elements (the TinyLlama-1.1B and 336M bench plans are checked against issue 23's targets by
`tools/launch_plan.py --check`, in `integration_tests/test_launch_plan.py`).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leanlm_testing import multi_tensor as mtt
from leanlm_testing.kernels import fused_kernel_marks, import_as_on_gpu
from optim_adafactor import Adafactor, _kernels
from optim_adafactor import _multi_kernels as multi
from optim_adafactor import _multi_stats_kernels as stats
from optim_adafactor import _multi_tables as tables
from optim_adafactor import _multi_vec_kernels as vec
from optim_adafactor.multi_tensor import plan_launches

pytestmark = fused_kernel_marks(_kernels, mtt.device())

SHAPES = [(13, 7), (40, 257), (33, 64), (64, 32), (5, 16), (200, 48), (9,)]
KW = {"beta1": 0.9, "weight_decay": 0.01}


def _make(params):
    return Adafactor(params, backend="triton", **KW)


@given(
    shapes=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 1500)), min_size=1, max_size=8),
    sub=st.sampled_from([8, 16]),
)
@settings(max_examples=60, deadline=None)
def test_items_cover_every_row_once_within_budget(shapes, sub) -> None:
    mats = [(torch.empty(s),) for s in shapes]
    t = tables.build(mats, list(range(len(mats))), sub=sub, block_m=64, block_c=16)
    seen = {i: [] for i in range(len(shapes))}
    for g in t.groups:
        assert g.partial_floats <= max(tables.MAX_PARTIAL_FLOATS, *(m for _, m in shapes))
        for mat, r0, r1, poff, _ in g.rows.tolist():
            n, m = shapes[g.mat0 + mat]
            assert 0 < r1 - r0 <= tables.rows_per_item(n, m, sub)
            assert 0 <= poff <= g.partial_floats - m
            seen[g.mat0 + mat].append((r0, r1))
        cols = {}
        for mat, c0, c1 in g.cols.tolist():
            cols.setdefault(mat, []).append((c0, c1))
        for mat, spans in cols.items():  # columns covered once, in order
            m = shapes[g.mat0 + mat][1]
            assert [c for span in spans for c in range(*span)] == list(range(m))
    for i, spans in seen.items():
        assert [r for span in spans for r in range(*span)] == list(range(shapes[i][0]))
        n, m = shapes[i]
        r = tables.rows_per_item(n, m, sub)
        assert r % sub == 0  # whole row tiles
        if n * m <= tables.MAX_PARTIAL_FLOATS:  # items of one tile would fit the budget
            # the most tiles within ITEM_ELEMENTS (one tile if it is wider)
            assert r * m <= tables.ITEM_ELEMENTS or r == sub
            assert (r + sub) * m > tables.ITEM_ELEMENTS


@pytest.mark.parametrize(
    ("n", "m", "sub", "rows"),
    [
        (2048, 2048, 8, 32),  # 65536 elements
        (2048, 5632, 8, 8),  # TinyLlama's down_proj: 45056 (16 rows, 90112, before)
        (4096, 14336, 8, 8),  # one 8-row tile: 114688 (fewer rows would mask tile rows)
        (64, 4001, 16, 16),  # unaligned rows (16-row tiles): 64016
        (8, 100_000, 8, 8),  # rows wider than 64K elements: still one tile
        (128256, 4096, 8, 32),  # 16-row items' partials (32.8M floats) exceed the 2^24 budget
    ],
)
def test_row_items_at_the_gpu_sizes(n: int, m: int, sub: int, rows: int) -> None:
    """On a GPU a row item holds the most whole rows within 64K elements (`ITEM_ELEMENTS`)."""
    gpu = import_as_on_gpu([tables.__name__])[tables.__name__]
    assert gpu.ITEM_ELEMENTS == 1 << 16
    assert gpu.rows_per_item(n, m, sub) == rows


def test_plan_is_what_the_step_launches() -> None:
    """Kernels and grids of the planned step equal those of a real (interpreter) step."""
    planned = mtt.check_plan_is_what_the_step_launches(
        plan_launches, _make, SHAPES, [multi, stats, vec, _kernels],
        ["_mt_stats_kernel", "_mt_apply_kernel"],
    )  # fmt: skip
    assert [lp.mean_elements for lp in planned if lp.kernel == "_mt_vec_kernel"] == [9]


def test_groups_step_exactly_as_one_launch_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch split into groups (small scratch budget) equals the PyTorch path and itself.

    Items of 4096 elements: the 40 x 257 matrix's (3 items of <= 15 rows) then fit the 800-float
    budget too, so every matrix keeps its items (1024: 14 items of 3 rows, 16 rows at 800).
    """
    monkeypatch.setattr(tables, "ITEM_ELEMENTS", 4096)
    mtt.check_groups_step_as_one_launch_set(
        Adafactor, KW, plan_launches, "_mt_stats_kernel", tables=tables, monkeypatch=monkeypatch
    )
