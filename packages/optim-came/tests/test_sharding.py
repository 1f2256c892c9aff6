"""Row-sharding protocol (optim-adafactor's): sharded steps (gloo, world size 2, uneven rows,
a rank with no rows) equal unsharded steps, with 3 bucketed collectives per step."""

from types import SimpleNamespace

import pytest
import torch

from leanlm_testing import assert_verbose_allclose, spawn
from optim_adafactor import ROW_SHARD_ATTR
from optim_came import CAME

# name -> (global shape, rows per rank); uneven on purpose, one rank may hold no rows
LAYOUT = {
    "matrix": ((11, 6), (4, 7)),
    "batched": ((5, 3, 4), (2, 3)),
    "vector": ((9,), (5, 4)),
    "empty_on_rank1": ((3, 8), (3, 0)),
}
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
}


def _grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    out = {}
    for name, (shape, _) in LAYOUT.items():
        g = torch.randn(shape, generator=gen)
        if len(shape) >= 2:
            g *= torch.rand(shape[:-1], generator=gen).add_(0.1).unsqueeze(-1)
        out[name] = g * 10.0 ** (torch.rand((), generator=gen).item() * 3 - 2)
    return out


def _scale(t: torch.Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0


def _worker(rank: int, world_size: int, config: str) -> None:
    kw, steps = CONFIGS[config]
    gen = torch.Generator().manual_seed(0)
    full = {name: torch.randn(shape, generator=gen) for name, (shape, _) in LAYOUT.items()}
    full["replicated"] = torch.randn(4, 4, generator=gen)  # unsharded, same on every rank
    ref_params = {k: v.clone().requires_grad_() for k, v in full.items()}
    ref = CAME(list(ref_params.values()), **{**kw, "backend": "torch"})

    local, offsets = {}, {}
    for name, (_, split) in LAYOUT.items():
        start = sum(split[:rank])
        offsets[name] = start
        local[name] = full[name][start : start + split[rank]].clone().requires_grad_()
    local["replicated"] = full["replicated"].clone().requires_grad_()
    opt = CAME(list(local.values()), **kw)
    # both declaration styles: the optimizer registry and the duck-typed tensor attribute
    opt.set_row_shard(
        local["matrix"], global_shape=LAYOUT["matrix"][0], row_offset=offsets["matrix"]
    )
    for name in ("batched", "vector", "empty_on_rank1"):
        declared = SimpleNamespace(
            global_shape=LAYOUT[name][0], row_offset=offsets[name], group=None
        )
        setattr(local[name], ROW_SHARD_ATTR, declared)

    for step in range(steps):
        grads = _grads(step)
        grads["replicated"] = torch.ones(4, 4) * (step + 1) * 0.01
        for name, g in grads.items():
            ref_params[name].grad = g.clone()
            start, rows = offsets.get(name, 0), local[name].shape[0]
            local[name].grad = g[start : start + rows].clone()
        ref.step()
        opt.step()
        # g² stats, Σu², instability stats: one bucketed all-reduce each, for 5 parameters
        assert opt.last_step_collectives == 3, opt.last_step_collectives

    for name, p in local.items():
        start = offsets.get(name, 0)
        expected = ref_params[name].detach()[start : start + p.shape[0]]
        # fp32; only the order of the cross-rank sums differs from the unsharded run. Errors are
        # judged against the tensor's scale (elements near 0 have no meaningful relative error).
        assert_verbose_allclose(p, expected, atol=1e-6 * _scale(expected), rtol=1e-6, name=name)
        ref_state, state = ref.state[ref_params[name]], opt.state[p]
        # the column statistics are the GLOBAL ones (ColossalAI's are the local block's)
        for key in ("exp_avg_sq_col", "exp_avg_res_col"):
            if key in state:
                col, ref_col = state[key], ref_state[key]
                if p.dim() > 2:  # dim 0 is a batch dim there: column stats are sharded too
                    ref_col = ref_col[start : start + p.shape[0]]
                assert_verbose_allclose(
                    col, ref_col, atol=1e-6 * _scale(ref_col), rtol=1e-5, name=f"{name} {key}"
                )
        for key in ("exp_avg_sq_row", "exp_avg_res_row", "exp_avg", "exp_avg_sq"):
            if key in state:
                ref_row = ref_state[key][start : start + p.shape[0]]
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
    if CONFIGS[config][0].get("backend") == "triton":
        from optim_came import _kernels

        if not _kernels.available(torch.device("cpu")):
            pytest.skip("Triton interpreter unavailable")
    spawn(_worker, config, world_size=2, tmp_path=tmp_path)
