"""Row-sharding protocol (optim-adafactor's): sharded steps (gloo, world size 2, uneven rows,
a rank with no rows) equal unsharded steps, with 3 bucketed collectives per step."""

import pytest
import torch

from leanlm_testing import assert_verbose_allclose
from leanlm_testing.row_sharding import run_row_sharded, spawn_row_sharded
from optim_adafactor import ROW_SHARD_ATTR
from optim_came import CAME, _kernels

CONFIGS = {
    "default": ({"lr": 1e-2}, 40),
    "extras_wd_clip": (
        {
            "lr": 1e-2,
            "weight_decay": 0.1,
            "clip_threshold": 0.7,
            "bias_correction": True,
            "instability_init": 1.0,
        },
        40,
    ),
    "triton": ({"lr": 1e-2, "backend": "triton"}, 5),
    # int8 exp_avg: blocks inside rows, noise hashed from global element indices (equal seeds:
    # `_seeded`): every rank's codes equal the unsharded run's rows
    "int8": ({"lr": 1e-2, "state_dtype": torch.int8}, 20),
    "int8_sr": ({"lr": 1e-2, "state_dtype": torch.int8, "stochastic_rounding": True}, 20),
    # the fused per-tensor kernels hash local indices: the shard's row offset is folded into the
    # hash constant (`optim_adafactor.quant.quant_seed`)
    "int8_sr_triton": (
        {"lr": 1e-2, "state_dtype": torch.int8, "stochastic_rounding": True, "backend": "triton"},
        4,
    ),
}


def _scale(t: torch.Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0


def _seeded(params, **kw) -> CAME:
    """CAME whose stochastic-rounding seed (drawn from torch's global generator) is fixed."""
    torch.manual_seed(0)
    return CAME(params, **kw)


def _worker(rank: int, world_size: int, config: str) -> None:
    kw, steps = CONFIGS[config]
    # g² stats, Σu², instability stats: one bucketed all-reduce each, for 5 parameters
    run = run_row_sharded(rank, _seeded, kw, steps, row_shard_attr=ROW_SHARD_ATTR, collectives=3)
    for name, p in run.local.items():
        expected = run.rows(name, run.ref_params[name].detach())
        # fp32; only the order of the cross-rank sums differs from the unsharded run. Errors are
        # judged against the tensor's scale (elements near 0 have no meaningful relative error).
        assert_verbose_allclose(p, expected, atol=1e-6 * _scale(expected), rtol=1e-6, name=name)
        ref_state, state = run.ref.state[run.ref_params[name]], run.opt.state[p]
        # the column statistics are the GLOBAL ones (ColossalAI's are the local block's)
        for key in ("exp_avg_sq_col", "exp_avg_res_col"):
            if key in state:
                col, ref_col = state[key], ref_state[key]
                if p.dim() > 2:  # dim 0 is a batch dim there: column stats are sharded too
                    ref_col = run.rows(name, ref_col)
                assert_verbose_allclose(
                    col, ref_col, atol=1e-6 * _scale(ref_col), rtol=1e-5, name=f"{name} {key}"
                )
        for key in ("exp_avg_sq_row", "exp_avg_res_row", "exp_avg", "exp_avg_sq", "exp_avg_scale"):
            if key in state:
                ref_row = run.rows(name, ref_state[key])
                assert_verbose_allclose(
                    state[key],
                    ref_row,
                    atol=1e-6 * _scale(ref_row),
                    rtol=1e-5,
                    name=f"{name} {key}",
                )


@pytest.mark.distributed
@pytest.mark.parametrize("config", list(CONFIGS))
def test_sharded_steps_equal_unsharded(config: str, tmp_path) -> None:
    spawn_row_sharded(_worker, config, CONFIGS[config][0], _kernels, tmp_path)
