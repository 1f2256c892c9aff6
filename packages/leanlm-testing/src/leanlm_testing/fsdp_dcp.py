"""FSDP2 optimizer checkpoints through DCP at changing world sizes (`fsdp.FsdpParityTests`).

A chain of phases trains `fsdp_net.Net` under `fully_shard` with a factored optimizer: 2 steps at
world 2, save with `torch.distributed.checkpoint`, load at world 3 (other row splits: 13 rows
are 7 + 6 at world 2 and 5 + 5 + 3 at world 3), 2 steps, save, load at world 1, 2 steps. Every
rank computes the loss of the same global batch, so every phase's averaged gradient is the
single-process gradient, and the final weights must equal 6 uninterrupted single-process steps.
The optimizer state goes through the optimizer package's DCP pair (`optim_adafactor.dtensor`'s
`distributed_state_dict` and `load_distributed_state_dict`, passed in as `StateFns`), so the row
statistics, column statistics and moments must each land on the rows the new layout gives the
rank; a checkpoint that lost the optimizer state is far off (checked on the reference).
`HSDP_PHASES` runs the middle phase on a (replicate 2, shard 2) mesh instead (the `slow` tests).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from leanlm_testing.distributed import spawn
from leanlm_testing.fsdp_net import MakeOptimizer, Net, batch, full_value

#: `(distributed_state_dict, load_distributed_state_dict)` of the optimizer package.
StateFns = tuple[Callable[..., dict[str, Any]], Callable[..., None]]
Phases = tuple[tuple[tuple[int, ...], int], ...]
#: (mesh shape, steps) per phase: 2 ranks, 3 ranks, 1 rank.
PHASES: Phases = (((2,), 2), ((3,), 2), ((1,), 2))
#: The same through HSDP: a (replicate 2, shard 2) mesh in the middle.
HSDP_PHASES: Phases = (((2,), 2), ((2, 2), 2), ((1,), 2))


def _global_loss(net: nn.Module, step: int) -> Any:
    """The mean loss of data ranks 0 and 1's batches: the same global batch on every rank."""
    dtype = next(net.parameters()).dtype
    losses = [net(*(t.to(dtype) for t in batch(step, rank))) for rank in (0, 1)]
    return (losses[0] + losses[1]) / 2


def _sharded(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    net = Net().to(dtype)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("rep", "shard")[-len(shape) :])
    for layer in (net.lin1, net.lin2, net.lin3):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def dcp_phase(
    rank: int,
    world_size: int,
    make_optimizer: MakeOptimizer,
    fns: StateFns,
    plan: tuple[str, int, int, int, tuple[int, ...], str],
) -> None:
    """`spawn` worker: load `folder/phase-{phase - 1}` (if any), train `steps` steps, save.

    `plan` is `(folder, phase, first step, steps, mesh shape, parameter dtype name)`.

    The last phase also writes the full weights to `folder/final.pt` (rank 0).
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    distributed_state_dict, load_distributed_state_dict = fns
    folder, phase, first_step, steps, shape, dtype = plan
    net = _sharded(shape, getattr(torch, dtype))
    opt = make_optimizer(net.parameters())
    if phase > 0:
        state = {
            "model": get_model_state_dict(net),
            "optim": distributed_state_dict(opt, net),
        }
        load(state, checkpoint_id=f"{folder}/phase-{phase - 1}")
        set_model_state_dict(net, state["model"])
        load_distributed_state_dict(opt, net, state["optim"])
    for step in range(first_step, first_step + steps):
        _global_loss(net, step).backward()
        opt.step()
        opt.zero_grad()
    state = {"model": get_model_state_dict(net), "optim": distributed_state_dict(opt, net)}
    save(state, checkpoint_id=f"{folder}/phase-{phase}")
    full = {n: full_value(p) for n, p in net.named_parameters()}
    if rank == 0:
        torch.save(full, f"{folder}/final.pt")
    dist.barrier()


def reference(
    make_optimizer: MakeOptimizer, steps: int, *, reset_at: int | None = None
) -> dict[str, Tensor]:
    """The weights after `steps` steps in one process (`reset_at`: a fresh optimizer there)."""
    torch.manual_seed(0)
    net = Net()
    opt = make_optimizer(net.parameters())
    for step in range(steps):
        if step == reset_at:
            opt = make_optimizer(net.parameters())
        _global_loss(net, step).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _run_phases(
    make_optimizer: MakeOptimizer,
    fns: StateFns,
    folder: Path,
    phases: Phases,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Tensor]:
    """Run `phases` through DCP checkpoints in `folder`; the full weights after the last."""
    folder.mkdir(parents=True)
    first = 0
    for phase, (shape, steps) in enumerate(phases):
        rendezvous = folder / f"rendezvous-{phase}"
        rendezvous.mkdir()
        plan = (str(folder), phase, first, steps, shape, str(dtype).removeprefix("torch."))
        world = math.prod(shape)
        spawn(dcp_phase, make_optimizer, fns, plan, world_size=world, tmp_path=rendezvous)
        first += steps
    weights: dict[str, Tensor] = torch.load(folder / "final.pt", weights_only=True)
    return weights


def check_dcp_chain(
    make_optimizer: MakeOptimizer,
    fns: StateFns,
    tmp_path: Path,
    tol: float,
    phases: Phases = PHASES,
) -> None:
    """Run `phases`; the final weights must be the single-process ones (norm-relative `tol`)."""
    torch.manual_seed(0)
    init = {n: p.detach().clone() for n, p in Net().named_parameters()}
    got = _run_phases(make_optimizer, fns, tmp_path / "dcp", phases)
    first = sum(steps for _, steps in phases)
    ref = reference(make_optimizer, first)
    lost = reference(make_optimizer, first, reset_at=phases[0][1])  # state lost at 1st load

    def error(a: dict[str, Tensor]) -> dict[str, float]:
        return {
            n: float((a[n] - ref[n]).double().norm() / (ref[n] - init[n]).double().norm())
            for n in ref
        }

    bad = {n: e for n, e in error(got).items() if not e <= tol}
    meshes = " -> ".join(str(shape) for shape, _ in phases)
    assert not bad, f"after meshes {meshes} through DCP, weights off by {bad} (tol {tol})"
    assert max(error(lost).values()) > 100 * tol, "losing the optimizer state went unnoticed"


def check_bf16_resume_bit_exact(
    optimizer: Callable[..., torch.optim.Optimizer],
    kw: dict[str, Any],
    fns: StateFns,
    tmp_path: Path,
) -> None:
    """A bf16 resume with stochastic rounding through DCP at world 2 must be bit-exact.

    2 + 2 steps must equal 4 uninterrupted steps bit for bit (the rounding noise continues
    where it was, it does not restart). The same 4 steps with round-to-nearest must differ (the
    noise matters here).
    """
    bf16 = torch.bfloat16

    def run(name: str, phases: Phases, rounding: bool) -> dict[str, Tensor]:
        make = partial(optimizer, **kw, stochastic_rounding=rounding)
        return _run_phases(make, fns, tmp_path / name, phases, bf16)

    straight = run("straight", (((2,), 4),), True)
    resumed = run("resumed", (((2,), 2), ((2,), 2)), True)
    differ = [n for n in straight if not torch.equal(straight[n], resumed[n])]
    assert not differ, f"a bf16 resume through DCP at world 2 changed {differ}"
    nearest = run("nearest", (((2,), 4),), False)
    assert any(not torch.equal(straight[n], nearest[n]) for n in straight), (
        "stochastic rounding changed nothing: the check would not see the noise restart"
    )
