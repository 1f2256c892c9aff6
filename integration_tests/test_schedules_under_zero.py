"""GradualPruning under shard-zero stage 3: the plain step() refuses, gathered() is exact.

At stage 3 the parameters are placeholders outside forward (shard-zero's `_units`), so a re-mask
cannot score them. `schedule.step()` there raises a RuntimeError that names the module and the
remedy, with the model, the masks and the step counter unchanged (before: torch's "more than one
element of the written-to tensor refers to a single memory location", after the first layer's
mask had been rebuilt from NaN placeholders). Called inside
`shard_zero.gathered(model, writeback=True)` it is exact: the masks equal those of one process on
the same global batch, and the updates match to shard-zero's parity tolerance (only the order of
the cross-rank gradient sums differs).
"""

import re

import pytest
import torch

from leanlm_testing import spawn
from leanlm_testing.models import random_batches, tiny_llama
from shard_zero import ZeroConfig, full_state_dict, gathered, prepare
from sparse_kernels import GradualPruning

STEPS = 6
TOL = 1e-4


def _schedule(model):
    return GradualPruning(model, final_sparsity=0.5, start_step=0, end_step=4, frequency=2)


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))


def _batches():
    return random_batches(256, batches=STEPS, batch_size=4, seq_len=16, seed=1)


def _reference():
    model = tiny_llama(seed=0).train()
    schedule = _schedule(model)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = _optimizer(list(model.parameters()))
    for batch in _batches():
        model(**batch, labels=batch["input_ids"]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    return init, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank, world):
    init, ref = _reference()
    model = tiny_llama(seed=0).train()
    schedule = _schedule(model)
    model, optimizer = prepare(model, _optimizer, ZeroConfig(stage=3, min_shard_numel=0))
    per = 4 // world
    for i, batch in enumerate(_batches()):
        ids = batch["input_ids"][rank * per : (rank + 1) * per]
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if i == 1:  # step 2 re-masks: the plain call refuses and changes nothing
            before = full_state_dict(model)
            message = (
                "GradualPruning: cannot re-mask model.layers.0.self_attn.q_proj at step 2: its "
                "weight is a stride-0 view"
            )
            with pytest.raises(RuntimeError, match=re.escape(message)) as err:
                schedule.step()
            assert "`with shard_zero.gathered(model, writeback=True): schedule.step()`" in str(
                err.value
            )
            assert schedule.step_count == 1
            after = full_state_dict(model)
            assert after.keys() == before.keys()
            for key, value in before.items():
                assert torch.equal(after[key], value), key
        with gathered(model, writeback=True):
            schedule.step()
    assert schedule.step_count == STEPS
    got = full_state_dict(model)
    assert got.keys() == ref.keys()
    mask_keys = [k for k in ref if k.endswith(".mask")]
    assert len(mask_keys) == 14
    for key, final in ref.items():
        if not final.is_floating_point():
            assert torch.equal(got[key], final), key
            continue
        d_ref = (final - init[key]).double()
        d_got = (got[key].to(final.dtype) - init[key]).double()
        err = (d_got - d_ref).norm() / d_ref.norm().clamp_min(1e-12)
        assert err <= TOL, f"{key}: update error {err:.3g} > {TOL}"


@pytest.mark.distributed
def test_gradual_pruning_under_zero3_refuses_then_is_exact_inside_gathered(tmp_path):
    spawn(_worker, world_size=2, tmp_path=tmp_path)
