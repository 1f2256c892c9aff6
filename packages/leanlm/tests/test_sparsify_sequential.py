"""`[sparsify] sequential`: Wanda / SparseGPT walk the decoder layers one at a time, each scored
on the outputs of the already-pruned layers before it (sparse-kernels' `sequential=True`)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import sparse_kernels
from leanlm.config import SparsifyConfig
from leanlm.run.pipeline import run_pipeline


def _masks(run_dir):
    folder = run_dir / "sparsify" / "model"
    return sparse_kernels.load_masks_(AutoModelForCausalLM.from_pretrained(folder), folder)


@pytest.fixture
def recorded(monkeypatch):
    calls = []
    real = sparse_kernels.sparsify_

    def record(*args, **kwargs):
        calls.append(kwargs.get("sequential"))
        return real(*args, **kwargs)

    monkeypatch.setattr(sparse_kernels, "sparsify_", record)
    return calls


def test_sequential_scoring_reaches_sparse_kernels_and_changes_later_layers(
    tmp_path, tiny_config, recorded
):
    masks = {}
    for sequential in (True, False):
        config = tiny_config(
            stages=("pretrain", "sparsify"),
            pretrain={"steps": 4, "eval_every": 4, "checkpoint_every": 4},
            sparsify=SparsifyConfig(steps=0, method="wanda", sequential=sequential),
        )
        run_pipeline(config, tmp_path / str(sequential))
        masks[sequential] = _masks(tmp_path / str(sequential))
    assert recorded == [True, False]
    first = [n for n in masks[True] if ".layers.0." in n]
    later = [n for n in masks[True] if ".layers.1." in n]
    assert first
    assert later
    assert masks[True].keys() == masks[False].keys()
    # layer 0 sees the same (dense) inputs either way; layer 1's inputs come out of the pruned
    # layer 0 when sequential, so some of its masks differ
    assert all(torch.equal(masks[True][n], masks[False][n]) for n in first)
    assert any(not torch.equal(masks[True][n], masks[False][n]) for n in later)
