"""Masks of sparse-kernels hold under shard-zero sharding, and sharded sparse training is exact.

A tiny Llama is 2:4-pruned (`sparsify_`, masks are parametrizations), then trained for a few
steps with AdamW (weight decay and momentum, which would move pruned weights if the masks did not
hold) under ZeRO stages 1-3 at world 2, and once in a single process on the same global batch.
Checked: every effective weight outside its mask is exactly zero, and the sharded updates equal
the single-process ones (relative update error per tensor <= 1e-4, as in shard-zero's parity
tests: only the order of the cross-rank gradient sums differs).
"""

import pytest
import torch

from leanlm_testing import spawn
from leanlm_testing.models import random_batches, tiny_llama
from shard_zero import ZeroConfig, full_state_dict, prepare
from sparse_kernels import SparsityConfig, masks, sparsify_

STEPS = 6
TOL = 1e-4


def _sparse_model():
    model = tiny_llama(seed=0).train()
    sparsify_(model, SparsityConfig(pattern="2:4", method="magnitude"))
    return model


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))


def _batches():
    return random_batches(256, batches=STEPS, batch_size=4, seq_len=16, seed=1)


def _effective(model, state):
    """Effective weights `original * mask` of every masked Linear, from a full state dict."""
    out = {}
    for name, mask in masks(model).items():
        original = state[f"{name}.parametrizations.weight.original"]
        out[name] = original * mask
    return out


def _reference():
    model = _sparse_model()
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = _optimizer(list(model.parameters()))
    for batch in _batches():
        model(**batch, labels=batch["input_ids"]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return init, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank, world, stage):
    init, ref = _reference()
    model, optimizer = prepare(
        _sparse_model(), _optimizer, ZeroConfig(stage=stage, min_shard_numel=0)
    )
    per = 4 // world
    for batch in _batches():
        ids = batch["input_ids"][rank * per : (rank + 1) * per]
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    got = full_state_dict(model)
    reference_model = _sparse_model()
    for name, weight in _effective(reference_model, got).items():
        mask = masks(reference_model)[name]
        assert (weight[~mask] == 0).all(), f"stage {stage}: {name} has weights outside its mask"
        groups = (weight.reshape(weight.shape[0], -1, 4) != 0).sum(-1)
        assert (groups <= 2).all(), f"stage {stage}: {name} is no longer 2:4"
    for key, final in ref.items():
        if not final.is_floating_point():  # the boolean masks: buffers, identical by construction
            assert torch.equal(got[key], final), key
            continue
        d_ref = (final - init[key]).double()
        d_got = (got[key].to(final.dtype) - init[key]).double()
        err = (d_got - d_ref).norm() / d_ref.norm().clamp_min(1e-12)
        assert err <= TOL, f"stage {stage}: {key}: update error {err:.3g} > {TOL}"


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_masks_hold_and_training_is_exact_under_zero(tmp_path, stage):
    spawn(_worker, stage, world_size=2, tmp_path=tmp_path)
