"""Mask properties for every pattern at random shapes (hypothesis), and config validation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_kernels import SparsityConfig, block_mask, nm_mask, unstructured_mask
from sparse_kernels.masks import block_scores, expand_blocks

SETTINGS = settings(max_examples=40, deadline=None)


def _scores(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed))


@SETTINGS
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 70),
    sparsity=st.floats(0.0, 0.99),
    per_row=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_unstructured_count_is_exact(rows, cols, sparsity, per_row, seed):
    s = _scores(rows, cols, seed)
    mask = unstructured_mask(s, sparsity, per_row=per_row)
    assert mask.shape == s.shape
    assert mask.dtype == torch.bool
    if per_row:
        assert (mask.sum(1) == cols - round(sparsity * cols)).all()
    else:
        assert int((~mask).sum()) == round(sparsity * rows * cols)
    # every kept score is >= every pruned score (within the ranking unit)
    if per_row:
        for r in range(rows):
            if mask[r].any() and (~mask[r]).any():
                assert s[r][mask[r]].min() >= s[r][~mask[r]].max()
    elif mask.any() and (~mask).any():
        assert s[mask].min() >= s[~mask].max()


@SETTINGS
@given(
    nm=st.tuples(st.integers(1, 7), st.integers(2, 8)).filter(lambda t: t[0] < t[1]),
    rows=st.integers(1, 20),
    groups=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_nm_groups_are_exact(nm, rows, groups, seed):
    n, m = nm
    s = _scores(rows, groups * m, seed)
    mask = nm_mask(s, n, m)
    per_group = mask.view(rows, groups, m)
    assert (per_group.sum(-1) == n).all()
    # the kept entries are the n largest of each group
    sg = s.view(rows, groups, m)
    kept_min = torch.where(per_group, sg, torch.inf).amin(-1)
    pruned_max = torch.where(~per_group, sg, -torch.inf).amax(-1)
    assert (kept_min >= pruned_max).all()


@SETTINGS
@given(
    rows=st.integers(1, 50),
    cols=st.integers(1, 50),
    block=st.integers(1, 16),
    sparsity=st.floats(0.0, 0.99),
    seed=st.integers(0, 2**16),
)
def test_block_grid_is_exact(rows, cols, block, sparsity, seed):
    s = _scores(rows, cols, seed)
    mask = block_mask(s, block, sparsity)
    rb, cb = -(-rows // block), -(-cols // block)
    pad = torch.nn.functional.pad(mask, (0, cb * block - cols, 0, rb * block - rows))
    tiles = pad.view(rb, block, cb, block).permute(0, 2, 1, 3).reshape(rb, cb, -1)
    # each tile is entirely kept or entirely pruned (on its real entries)
    real = torch.nn.functional.pad(
        torch.ones_like(mask), (0, cb * block - cols, 0, rb * block - rows)
    )
    real_t = real.view(rb, block, cb, block).permute(0, 2, 1, 3).reshape(rb, cb, -1)
    kept_tiles = (tiles & real_t).sum(-1) == real_t.sum(-1)
    empty_tiles = (tiles & real_t).sum(-1) == 0
    assert (kept_tiles | empty_tiles).all()
    assert int(empty_tiles.sum()) == round(sparsity * rb * cb)
    scores = block_scores(s, block)
    if kept_tiles.any() and empty_tiles.any():
        assert scores[kept_tiles].min() >= scores[empty_tiles].max()


def test_nm_validation_names_n_and_m():
    with pytest.raises(ValueError, match=r"`n` \(5\).*`m` \(4\)"):
        SparsityConfig(pattern="5:4")
    with pytest.raises(ValueError, match=r"`n` \(0\)"):
        SparsityConfig(pattern="0:4")
    with pytest.raises(ValueError, match=r"multiple of `m` \(4\)"):
        nm_mask(torch.rand(3, 6), 2, 4)
    with pytest.raises(ValueError, match="pattern"):
        SparsityConfig(pattern="diagonal")
    with pytest.raises(ValueError, match="sparsity"):
        SparsityConfig(sparsity=1.0)
    with pytest.raises(ValueError, match="method"):
        SparsityConfig(method="random")  # type: ignore[arg-type]


def test_config_target_sparsity():
    assert SparsityConfig(pattern="2:4").target_sparsity == 0.5
    assert SparsityConfig(pattern="1:8").target_sparsity == 0.875
    assert SparsityConfig(pattern="block", sparsity=0.9).target_sparsity == 0.9


def test_fp64_scores_are_ranked_in_fp64():
    """1 + 1e-12 and 1 are one value in fp32; fp64 keeps them apart (and 1e39 finite)."""
    tie = torch.tensor(
        [[1.0, 1.0 + 1e-12, 0.0, 0.0], [1.0 + 1e-12, 1.0, 0.0, 0.0]], dtype=torch.float64
    )
    assert nm_mask(tie, 1, 4).tolist() == [[False, True, False, False], [True, False, False, False]]
    top = torch.tensor([[1.0 + 1e-12, 1.0, 2.0, 3.0]], dtype=torch.float64)
    assert unstructured_mask(top, 0.25).tolist() == [[True, False, True, True]]
    assert unstructured_mask(top, 0.25, per_row=True).tolist() == [[True, False, True, True]]
    huge = torch.tensor([[1e39, 2e39, 0.0, 0.0]], dtype=torch.float64)  # inf in fp32
    assert nm_mask(huge, 1, 4).tolist() == [[False, True, False, False]]
    tiles = torch.ones(4, 4, dtype=torch.float64)
    tiles[2:, 2:] += 1e-12  # the one tile of 4 with a larger mean
    assert (
        block_mask(tiles, 2, 0.75).tolist()
        == expand_blocks(torch.tensor([[False, False], [False, True]]), 2, (4, 4)).tolist()
    )
