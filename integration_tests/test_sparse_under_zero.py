"""Masks of sparse-kernels hold under shard-zero sharding, and sharded sparse training is exact.

A tiny Llama is 2:4-pruned (`sparsify_`, masks are parametrizations), then trained for a few
steps with AdamW (weight decay and momentum, which would move pruned weights if the masks did not
hold) under ZeRO stages 1-3 at world 2, and once in a single process on the same global batch.
Checked: every effective weight outside its mask is exactly zero, and the sharded updates equal
the single-process ones (relative update error per tensor <= 1e-4, as in shard-zero's parity
tests: only the order of the cross-rank gradient sums differs).

The same tiny Llama block-pruned and converted to `BlockSparseLinear` layers (`to_block_sparse_`:
each stores its kept tiles as one (tiles, b, b) `values` parameter) trains under ZeRO stages 1-3
with AdamW and with CAME (factored statistics per b x b tile): shard-zero cuts those parameters
by whole tiles (their leading dim), and the updates equal the single-process ones as above.
"""

import pytest
import torch

from leanlm_testing import spawn
from leanlm_testing.models import random_batches, tiny_llama
from optim_came import CAME
from shard_zero import ZeroConfig, full_state_dict, prepare
from sparse_kernels import BlockSparseLinear, SparsityConfig, masks, sparsify_, to_block_sparse_

STEPS = 6
TOL = 1e-4


def _sparse_model():
    model = tiny_llama(seed=0).train()
    sparsify_(model, SparsityConfig(pattern="2:4", method="magnitude"))
    return model


def _block_sparse_model():
    """Block 16, 55% of the tiles pruned per Linear: q_proj keeps 7 of 16 (split 4 + 3)."""
    model = tiny_llama(seed=0).train()
    config = SparsityConfig(pattern="block", block_size=16, sparsity=0.55, method="magnitude")
    sparsify_(model, config)
    to_block_sparse_(model, block_size=16, backend="torch")
    return model


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))


def _came(params):
    # instability_init 1.0 as in shard-zero's parity tests: with 0 the first step divides by
    # near-zero residuals, which turns the cross-rank summation order into a 7e-4 update error
    # (measured on the dense embedding too, not a block-sparse effect)
    return CAME(params, lr=1e-2, weight_decay=0.01, instability_init=1.0)


def _batches():
    return random_batches(256, batches=STEPS, batch_size=4, seq_len=16, seed=1)


def _effective(model, state):
    """Effective weights `original * mask` of every masked Linear, from a full state dict."""
    out = {}
    for name, mask in masks(model).items():
        original = state[f"{name}.parametrizations.weight.original"]
        out[name] = original * mask
    return out


def _reference(make_model, make_optimizer):
    model = make_model()
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = make_optimizer(list(model.parameters()))
    for batch in _batches():
        model(**batch, labels=batch["input_ids"]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return init, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_sharded(rank, world, model, optimizer):
    per = 4 // world
    for batch in _batches():
        ids = batch["input_ids"][rank * per : (rank + 1) * per]
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return full_state_dict(model)


def _assert_updates_equal(init, ref, got, what):
    assert got.keys() == ref.keys(), what
    for key, final in ref.items():
        if not final.is_floating_point():  # masks, tile indices: buffers, equal by construction
            assert torch.equal(got[key], final), f"{what}: {key}"
            continue
        d_ref = (final - init[key]).double()
        d_got = (got[key].to(final.dtype) - init[key]).double()
        err = (d_got - d_ref).norm() / d_ref.norm().clamp_min(1e-12)
        assert err <= TOL, f"{what}: {key}: update error {err:.3g} > {TOL}"


def _worker(rank, world, stage):
    init, ref = _reference(_sparse_model, _optimizer)
    model, optimizer = prepare(
        _sparse_model(), _optimizer, ZeroConfig(stage=stage, min_shard_numel=0)
    )
    got = _train_sharded(rank, world, model, optimizer)
    reference_model = _sparse_model()
    for name, weight in _effective(reference_model, got).items():
        mask = masks(reference_model)[name]
        assert (weight[~mask] == 0).all(), f"stage {stage}: {name} has weights outside its mask"
        groups = (weight.reshape(weight.shape[0], -1, 4) != 0).sum(-1)
        assert (groups <= 2).all(), f"stage {stage}: {name} is no longer 2:4"
    _assert_updates_equal(init, ref, got, f"stage {stage}")


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_masks_hold_and_training_is_exact_under_zero(tmp_path, stage):
    spawn(_worker, stage, world_size=2, tmp_path=tmp_path)


def _block_sparse_worker(rank, world):
    for name, make_optimizer in (("adamw", _optimizer), ("came", _came)):
        init, ref = _reference(_block_sparse_model, make_optimizer)
        for stage in (1, 2, 3):
            what = f"stage {stage} {name}"
            model = _block_sparse_model()
            assert sum(isinstance(m, BlockSparseLinear) for m in model.modules()) == 2 * 7
            config = ZeroConfig(stage=stage, min_shard_numel=0)
            model, optimizer = prepare(model, make_optimizer, config)
            # the optimizer steps this rank's whole tiles of every (tiles, b, b) `values`
            shards = [
                (tuple(p.shape), p.leanlm_row_shard.global_shape)
                for group in optimizer.param_groups
                for p in group["params"]
                if p.dim() == 3
            ]
            assert len(shards) == 2 * 7, what
            for local, full in shards:
                assert local[0] < full[0], (what, local, full)
                assert local[1:] == full[1:] == (16, 16), (what, local, full)
            _assert_updates_equal(init, ref, _train_sharded(rank, world, model, optimizer), what)


@pytest.mark.distributed
def test_block_sparse_layers_shard_by_tiles_and_train_exactly_under_zero(tmp_path):
    spawn(_block_sparse_worker, world_size=2, tmp_path=tmp_path)
