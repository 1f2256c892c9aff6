"""Row-sharding protocol runs: an optimizer on row shards next to the same optimizer unsharded.

Call `run_row_sharded` inside a `leanlm_testing.spawn` worker (world size 2). The optimizer
packages pass their optimizer class and the name of the duck-typed row-shard attribute
(`optim_adafactor.ROW_SHARD_ATTR`); the optimizer has `set_row_shard(p, global_shape=...,
row_offset=...)` and counts its collectives in `last_step_collectives`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from leanlm_testing.distributed import spawn

# name -> (global shape, rows per rank); uneven on purpose, one rank may hold no rows
LAYOUT: dict[str, tuple[tuple[int, ...], tuple[int, int]]] = {
    "matrix": ((11, 6), (4, 7)),
    "batched": ((5, 3, 4), (2, 3)),
    "vector": ((9,), (5, 4)),
    "empty_on_rank1": ((3, 8), (3, 0)),
}


def layout_grads(step: int) -> dict[str, torch.Tensor]:
    """Seeded full (unsharded) gradients of the `LAYOUT` tensors at `step`.

    Rows (and columns) get varied scales so that the factored statistics matter, and each step
    a random overall scale over three decades.
    """
    gen = torch.Generator().manual_seed(1000 + step)
    out = {}
    for name, (shape, _) in LAYOUT.items():
        g = torch.randn(shape, generator=gen)
        if len(shape) >= 2:  # heteroscedastic rows/columns make the factors matter
            g *= torch.rand(shape[:-1], generator=gen).add_(0.1).unsqueeze(-1)
        out[name] = g * 10.0 ** (torch.rand((), generator=gen).item() * 3 - 2)
    return out


@dataclass
class RowShardedRun:
    """Both runs after the last step: the unsharded reference and this rank's sharded one.

    `ref_params` and `local` map the `LAYOUT` names and "replicated" (a tensor every rank holds
    whole) to parameters; `offsets` gives each sharded tensor's first row on this rank.
    """

    ref: Any
    ref_params: dict[str, torch.Tensor]
    opt: Any
    local: dict[str, torch.Tensor]
    offsets: dict[str, int]

    def rows(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The rows of `full` (a reference tensor of parameter `name`) that this rank holds."""
        start = self.offsets.get(name, 0)
        return full[start : start + self.local[name].shape[0]]


def run_row_sharded(
    rank: int,
    optimizer: Callable[..., Any],
    kw: dict[str, Any],
    steps: int,
    *,
    row_shard_attr: str,
    collectives: int,
) -> RowShardedRun:
    """`steps` steps of `optimizer(**kw)` on this rank's rows, and unsharded with backend "torch".

    The sharded tensors are declared both ways: "matrix" through `opt.set_row_shard`, the
    others through the duck-typed `row_shard_attr` attribute (no group: the default one). Every
    step must make exactly `collectives` collectives (`opt.last_step_collectives`).
    """
    gen = torch.Generator().manual_seed(0)
    full = {name: torch.randn(shape, generator=gen) for name, (shape, _) in LAYOUT.items()}
    full["replicated"] = torch.randn(4, 4, generator=gen)  # unsharded, same on every rank
    ref_params = {k: v.clone().requires_grad_() for k, v in full.items()}
    ref = optimizer(list(ref_params.values()), **{**kw, "backend": "torch"})

    local, offsets = {}, {}
    for name, (_, split) in LAYOUT.items():
        start = sum(split[:rank])
        offsets[name] = start
        local[name] = full[name][start : start + split[rank]].clone().requires_grad_()
    local["replicated"] = full["replicated"].clone().requires_grad_()
    opt = optimizer(list(local.values()), **kw)
    # both declaration styles: the optimizer registry and the duck-typed tensor attribute
    opt.set_row_shard(
        local["matrix"], global_shape=LAYOUT["matrix"][0], row_offset=offsets["matrix"]
    )
    for name in ("batched", "vector", "empty_on_rank1"):
        declared = SimpleNamespace(
            global_shape=LAYOUT[name][0], row_offset=offsets[name], group=None
        )
        setattr(local[name], row_shard_attr, declared)

    for step in range(steps):
        grads = layout_grads(step)
        grads["replicated"] = torch.ones(4, 4) * (step + 1) * 0.01
        for name, g in grads.items():
            ref_params[name].grad = g.clone()
            start, rows = offsets.get(name, 0), local[name].shape[0]
            local[name].grad = g[start : start + rows].clone()
        ref.step()
        opt.step()
        assert opt.last_step_collectives == collectives, opt.last_step_collectives
    return RowShardedRun(ref=ref, ref_params=ref_params, opt=opt, local=local, offsets=offsets)


def spawn_row_sharded(
    worker: Callable[..., None],
    config: str,
    kw: dict[str, Any],
    kernels: ModuleType,
    tmp_path: Any,
) -> None:
    """`spawn(worker, config)` on 2 ranks: the test of one of a package's `CONFIGS`.

    Skipped for `kw` with `backend="triton"` where the package's `kernels` module cannot run on
    the CPU (no Triton interpreter).
    """
    if kw.get("backend") == "triton" and not kernels.available(torch.device("cpu")):
        pytest.skip("Triton interpreter unavailable")
    spawn(worker, config, world_size=2, tmp_path=tmp_path)
