"""prune-distill's `distill` trains a student prepared by shard-zero exactly as in one process.

A tiny Llama is pruned (`prune`) and the student distilled from it for a few steps with CAME and
gradient clipping that is active (`max_grad_norm` below the gradients' norm), once in one process
and once prepared by shard-zero at stages 1-3, world 2, on the same global batches, with
shard-zero's optimizer passed in through `DistillConfig.optimizer`. Checked: the updates equal
the single-process ones (relative update error per tensor <= 1e-4, as in shard-zero's parity
tests), so `distill` clipped through the engine's `clip_grad_norm_`; and the documented
factory over `student.parameters()` (whose gradients shard-zero keeps in its own buffers) is
refused on its first step instead of stepping nothing.
"""

import pytest
import torch

from leanlm_testing import spawn
from leanlm_testing.models import random_batches, tiny_llama
from optim_came import CAME
from prune_distill import DistillConfig, PruneTarget, collect_importance, distill, prune
from shard_zero import ZeroConfig, full_state_dict, prepare

TOL = 1e-4
CLIP = 1e-2  # below the gradients' global norm on every step: clipping changes the updates


def _came(params):
    # instability_init 1.0 as in shard-zero's parity tests (see test_sparse_under_zero.py)
    return CAME(params, lr=1e-2, weight_decay=0.01, instability_init=1.0)


def _teacher_and_student():
    teacher = tiny_llama(seed=0).eval()
    calibration = random_batches(256, batches=2, batch_size=4, seq_len=16, seed=2)
    scores = collect_importance(teacher, calibration, layer_loss=False)
    student = prune(teacher, scores, PruneTarget(hidden_size=48, intermediate_size=64))
    return teacher, student


def _batches(rank=0, world=1):
    per = 4 // world
    return [
        {"input_ids": b["input_ids"][rank * per : (rank + 1) * per]}
        for b in random_batches(256, batches=4, batch_size=4, seq_len=16, seed=1)
    ]


def _worker(rank, world):
    teacher, student = _teacher_and_student()
    init = {k: v.detach().clone() for k, v in student.state_dict().items()}
    distill(student, teacher, _batches(), DistillConfig(optimizer=_came, max_grad_norm=CLIP))
    ref = {k: v.detach().clone() for k, v in student.state_dict().items()}
    unclipped = _teacher_and_student()[1]
    distill(unclipped, teacher, _batches(), DistillConfig(optimizer=_came, max_grad_norm=None))
    assert any(not torch.equal(unclipped.state_dict()[k], v) for k, v in ref.items())
    for stage in (1, 2, 3):
        config = ZeroConfig(stage=stage, min_shard_numel=0)
        model, optimizer = prepare(_teacher_and_student()[1], _came, config)
        cfg = DistillConfig(optimizer=lambda params, opt=optimizer: opt, max_grad_norm=CLIP)
        distill(model, teacher, _batches(rank, world), cfg)
        got = full_state_dict(model)
        for key, final in ref.items():
            d_ref = (final - init[key]).double()
            d_got = (got[key] - init[key]).double()
            err = (d_got - d_ref).norm() / d_ref.norm().clamp_min(1e-12)
            assert err <= TOL, f"stage {stage}: {key}: update error {err:.3g} > {TOL}"
        # before: an optimizer over student.parameters() stepped nothing, silently
        model, _ = prepare(_teacher_and_student()[1], _came, config)
        with pytest.raises(RuntimeError, match="no parameter of `student` received a gradient"):
            distill(model, teacher, _batches(rank, world), DistillConfig(optimizer=_came))


@pytest.mark.distributed
def test_distill_under_zero_matches_one_process_with_clipping(tmp_path):
    spawn(_worker, world_size=2, tmp_path=tmp_path)
