"""Row-sharding protocol: sharded steps (gloo, world size 2, uneven rows) == unsharded steps."""

from types import SimpleNamespace

import pytest
import torch

from leanlm_testing import assert_verbose_allclose, spawn
from optim_adafactor import ROW_SHARD_ATTR, Adafactor, RowShard
from optim_adafactor.sharding import make_row_shard

# name -> (global shape, rows per rank); uneven on purpose, one rank may hold no rows
LAYOUT = {
    "matrix": ((11, 6), (4, 7)),
    "batched": ((5, 3, 4), (2, 3)),
    "vector": ((9,), (5, 4)),
    "empty_on_rank1": ((3, 8), (3, 0)),
}
CONFIGS = {
    "hf_default": ({}, 30),
    "hf_momentum_wd": ({"beta1": 0.9, "weight_decay": 0.1, "clip_threshold": 0.7}, 30),
    "external_lr_noclip": (
        {"lr": 1e-2, "relative_step": False, "scale_parameter": False, "clip_threshold": None},
        30,
    ),
    "torch": ({"semantics": "torch", "eps": (None, 1e-3), "weight_decay": 0.05}, 30),
    "triton": ({"backend": "triton", "beta1": 0.5}, 6),
}


def _grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    out = {}
    for name, (shape, _) in LAYOUT.items():
        g = torch.randn(shape, generator=gen)
        if len(shape) >= 2:  # heteroscedastic rows/columns make the factors matter
            g *= torch.rand(shape[:-1], generator=gen).add_(0.1).unsqueeze(-1)
        out[name] = g * 10.0 ** (torch.rand((), generator=gen).item() * 3 - 2)
    return out


def _worker(rank: int, world_size: int, config: str) -> None:
    kw, steps = CONFIGS[config]
    gen = torch.Generator().manual_seed(0)
    full = {name: torch.randn(shape, generator=gen) for name, (shape, _) in LAYOUT.items()}
    full["replicated"] = torch.randn(4, 4, generator=gen)  # unsharded, same on every rank
    ref_params = {k: v.clone().requires_grad_() for k, v in full.items()}
    ref = Adafactor(list(ref_params.values()), **{**kw, "backend": "torch"})

    local, offsets = {}, {}
    for name, (_, split) in LAYOUT.items():
        start = sum(split[:rank])
        offsets[name] = start
        local[name] = full[name][start : start + split[rank]].clone().requires_grad_()
    local["replicated"] = full["replicated"].clone().requires_grad_()
    opt = Adafactor(list(local.values()), **kw)
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
        clip_on = kw.get("clip_threshold", 1.0) is not None
        assert opt.last_step_collectives == (2 if clip_on else 1), opt.last_step_collectives

    for name, p in local.items():
        start = offsets.get(name, 0)
        expected = ref_params[name].detach()[start : start + p.shape[0]]
        # fp32; only the order of the cross-rank sums differs from the unsharded run
        assert_verbose_allclose(p, expected, atol=1e-7, rtol=1e-6, name=f"rank {rank} {name}")
        ref_state, state = ref.state[ref_params[name]], opt.state[p]
        if "exp_avg_sq_col" in state:
            col, ref_col = state["exp_avg_sq_col"], ref_state["exp_avg_sq_col"]
            if p.dim() > 2:  # dim 0 is a batch dim there: column stats are sharded too
                ref_col = ref_col[start : start + p.shape[0]]
            assert_verbose_allclose(col, ref_col, atol=0, rtol=1e-5, name=f"{name} col")


@pytest.mark.distributed
@pytest.mark.parametrize("config", list(CONFIGS))
def test_sharded_steps_equal_unsharded(config: str, tmp_path) -> None:
    if CONFIGS[config][0].get("backend") == "triton":
        from optim_adafactor import _kernels

        if not _kernels.available(torch.device("cpu")):
            pytest.skip("Triton interpreter unavailable")
    spawn(_worker, config, world_size=2, tmp_path=tmp_path)


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
