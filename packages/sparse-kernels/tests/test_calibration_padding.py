"""Calibration leaves padded positions out: a padded batch calibrates as its sequences unpadded."""

import pytest
import torch

from leanlm_testing.models import tiny_llama
from sparse_kernels import SparsityConfig, select_targets, sparsify_
from sparse_kernels.calibration import collect_input_stats


def _same_text():
    """Two sequences (8 and 3 tokens) as two unpadded batches, and as one right-padded batch."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (1, 8), generator=gen)
    b = torch.randint(0, 256, (1, 3), generator=gen)
    unpadded = [{"input_ids": a}, {"input_ids": b}]
    ids = torch.zeros(2, 8, dtype=torch.long)
    ids[0], ids[1, :3] = a[0], b[0]
    mask = torch.zeros(2, 8, dtype=torch.long)
    mask[0], mask[1, :3] = 1, 1
    return unpadded, [{"input_ids": ids, "attention_mask": mask}]


def test_statistics_count_real_tokens_only():
    unpadded, padded = _same_text()
    model = tiny_llama()
    targets = select_targets(model)
    ref = collect_input_stats(model, targets, unpadded, hessian=True)
    got = collect_input_stats(model, targets, padded, hessian=True)
    for name in targets:
        assert got[name].tokens == ref[name].tokens == 11, name
        torch.testing.assert_close(got[name].sumsq, ref[name].sumsq, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[name].hessian(), ref[name].hessian(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sequential", [False, True])
@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
@pytest.mark.parametrize("pattern", ["2:4", "unstructured"])
def test_padded_and_unpadded_batches_give_the_same_masks(pattern, method, sequential):
    unpadded, padded = _same_text()
    config = SparsityConfig(pattern=pattern, method=method, sparsity=0.5)
    ref = sparsify_(tiny_llama(), config, calibration=unpadded, sequential=sequential)
    got = sparsify_(tiny_llama(), config, calibration=padded, sequential=sequential)
    assert set(got) == set(ref)
    for name, mask in ref.items():
        assert torch.equal(got[name], mask), name


def test_a_batch_without_real_tokens_reaches_no_layer():
    _, padded = _same_text()
    padded[0]["attention_mask"] = torch.zeros_like(padded[0]["attention_mask"])
    with pytest.raises(ValueError, match=r"no calibration token reached model\.layers\.0\."):
        sparsify_(tiny_llama(), SparsityConfig(method="wanda"), calibration=padded)
