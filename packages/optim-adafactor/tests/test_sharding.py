"""Row-sharding protocol: sharded steps (gloo, world size 2, uneven rows) == unsharded steps."""

import pytest
import torch

from leanlm_testing import assert_verbose_allclose
from leanlm_testing.row_sharding import run_row_sharded, spawn_row_sharded
from optim_adafactor import ROW_SHARD_ATTR, Adafactor, RowShard, _kernels
from optim_adafactor.sharding import make_row_shard

CONFIGS = {
    "hf_default": ({}, 30),
    "hf_momentum_wd": ({"beta1": 0.9, "weight_decay": 0.1, "clip_threshold": 0.7}, 30),
    "external_lr_noclip": (
        {"lr": 1e-2, "relative_step": False, "scale_parameter": False, "clip_threshold": None},
        30,
    ),
    "torch": ({"semantics": "torch", "eps": (None, 1e-3), "weight_decay": 0.05}, 30),
    "triton": ({"backend": "triton", "beta1": 0.5}, 6),
    # int8 momentum: blocks inside rows, noise hashed from global element indices (the fused
    # shard folds its row offset into the hash constant): each rank's codes are the whole run's
    "int8_sr": ({"beta1": 0.9, "state_dtype": torch.int8, "stochastic_rounding": True}, 10),
    "int8_sr_triton": (
        {"backend": "triton", "beta1": 0.9, "state_dtype": torch.int8, "stochastic_rounding": True},
        4,
    ),
}


def _seeded(params, **kw) -> Adafactor:
    """Adafactor whose stochastic-rounding seed (drawn from torch's global generator) is fixed."""
    torch.manual_seed(0)
    return Adafactor(params, **kw)


def _worker(rank: int, world_size: int, config: str) -> None:
    kw, steps = CONFIGS[config]
    clip_on = kw.get("clip_threshold", 1.0) is not None
    run = run_row_sharded(
        rank, _seeded, kw, steps, row_shard_attr=ROW_SHARD_ATTR, collectives=2 if clip_on else 1
    )
    for name, p in run.local.items():
        expected = run.rows(name, run.ref_params[name].detach())
        # fp32; only the order of the cross-rank sums differs from the unsharded run
        assert_verbose_allclose(p, expected, atol=1e-7, rtol=1e-6, name=f"rank {rank} {name}")
        ref_state, state = run.ref.state[run.ref_params[name]], run.opt.state[p]
        if "exp_avg_sq_col" in state:
            col, ref_col = state["exp_avg_sq_col"], ref_state["exp_avg_sq_col"]
            if p.dim() > 2:  # dim 0 is a batch dim there: column stats are sharded too
                ref_col = run.rows(name, ref_col)
            assert_verbose_allclose(col, ref_col, atol=0, rtol=1e-5, name=f"{name} col")
        if state.get("exp_avg") is not None and state["exp_avg"].dtype == torch.int8:
            assert torch.equal(state["exp_avg"], run.rows(name, ref_state["exp_avg"])), name
            scale = run.rows(name, ref_state["exp_avg_scale"])
            assert_verbose_allclose(state["exp_avg_scale"], scale, atol=0, rtol=1e-5, name=name)


@pytest.mark.distributed
@pytest.mark.parametrize("config", list(CONFIGS))
def test_sharded_steps_equal_unsharded(config: str, tmp_path) -> None:
    spawn_row_sharded(_worker, config, CONFIGS[config][0], _kernels, tmp_path)


def test_row_shard_declaration_is_validated() -> None:
    p = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="global_shape"):
        make_row_shard(p, global_shape=(6, 5), row_offset=0)
    with pytest.raises(ValueError, match="`row_offset` \\(4\\)"):
        make_row_shard(p, global_shape=(6, 4), row_offset=4)
    with pytest.raises(TypeError, match="`row_offset`"):
        make_row_shard(p, global_shape=(6, 4), row_offset=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0-dim"):
        make_row_shard(torch.tensor(1.0), global_shape=(), row_offset=0)
    shard = make_row_shard(p, global_shape=[6, 4], row_offset=3)
    assert shard == RowShard(global_shape=(6, 4), row_offset=3)
    assert shard.global_numel == 24
