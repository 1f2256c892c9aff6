"""FSDP2 (`fully_shard`) parity runs for optimizers: sharded steps vs the single-process steps.

Call `fsdp_update_errors` inside a `leanlm_testing.spawn` worker (gloo, CPU). It builds a small
model whose matrices have row counts that do not divide the world sizes 2 and 4 (some ranks hold
fewer rows, or none) and odd column counts, plus a vector and a 3-D parameter; shards it with
`fully_shard`; and steps it next to an unsharded copy that sees the same data.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from functools import partial
from typing import Any, ClassVar
from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from leanlm_testing.distributed import spawn
from leanlm_testing.fsdp_dcp import HSDP_PHASES, check_bf16_resume_bit_exact, check_dcp_chain
from leanlm_testing.fsdp_net import MakeOptimizer, Net, batch, full_value


def fsdp_update_errors(
    rank: int,
    world_size: int,
    make_optimizer: MakeOptimizer,
    *,
    steps: int,
    mesh_shape: tuple[int, ...] | None = None,
    resume_at: int | None = None,
) -> dict[str, float]:
    """Per parameter, the largest norm-relative error of a step's update over `steps` steps.

    The reference is an unsharded copy stepped by `make_optimizer` on the gradient of the mean
    of the ranks' losses (what FSDP2's averaged gradients give). `mesh_shape` (default
    `(world_size,)`) of two dims is HSDP: (replicate, shard); every replica then sees the same
    data so that the replicas stay equal, as HSDP requires. `resume_at`: before that step, the
    sharded optimizer is replaced by a new one loaded from a copy of its `state_dict()` (each
    rank its own), so that the following steps check the saved state too.
    """
    shape = mesh_shape or (world_size,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("rep", "shard")[-len(shape) :])
    torch.manual_seed(0)
    ref = Net()
    net = copy.deepcopy(ref)
    for layer in (net.lin1, net.lin2, net.lin3):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    ref_opt = make_optimizer(ref.parameters())
    opt = make_optimizer(net.parameters())
    params = dict(net.named_parameters())
    for name, p in params.items():
        assert isinstance(p, DTensor), f"{name} is not a DTensor: FSDP2 did not shard it"
    shard_ranks = shape[-1]
    data_rank = mesh.get_local_rank(len(shape) - 1)  # replicas of a shard see the same data
    errors = dict.fromkeys((n for n, _ in ref.named_parameters()), 0.0)
    for step in range(steps):
        if step == resume_at:
            saved = copy.deepcopy(opt.state_dict())
            opt = make_optimizer(net.parameters())
            opt.load_state_dict(saved)
        net(*batch(step, data_rank)).backward()
        ref_loss = sum(ref(*batch(step, r)) for r in range(shard_ranks))
        (ref_loss / shard_ranks).backward()
        _step_both(ref, ref_opt, params, opt, errors)
        ref_opt.zero_grad()
        opt.zero_grad()
    dist.barrier()
    return errors


def _step_both(
    ref: nn.Module,
    ref_opt: torch.optim.Optimizer,
    params: Mapping[str, Tensor],
    opt: torch.optim.Optimizer,
    errors: dict[str, float],
) -> None:
    """Step both optimizers; raise `errors[name]` to the step's norm-relative update error.

    `params` are the distributed parameters by `ref`'s names; their update is compared, gathered,
    with that of `ref`'s parameter of the same name.
    """
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    with torch.no_grad():
        gathered = {n: full_value(p) for n, p in params.items()}
    ref_opt.step()
    opt.step()
    for n, p in params.items():
        ref_update = ref.get_parameter(n).detach() - before[n]
        update = full_value(p) - gathered[n]
        err = float((update - ref_update).norm() / ref_update.norm().clamp(min=1e-30))
        errors[n] = max(errors[n], err)


def dtensor_update_errors(
    rank: int, world_size: int, make_optimizer: MakeOptimizer, *, steps: int
) -> dict[str, float]:
    """As `fsdp_update_errors`, for DTensor parameters made with `distribute_tensor`.

    Matrices and the 3-D tensor are `Replicate()`, vectors `Shard(0)`; the gradients are the
    unsharded model's, distributed the same way (every rank computes them on the same data).
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    ref = Net()
    placements = {
        n: [Shard(0)] if p.dim() == 1 else [Replicate()] for n, p in ref.named_parameters()
    }
    params = {
        n: nn.Parameter(distribute_tensor(p.detach().clone(), mesh, placements[n]))
        for n, p in ref.named_parameters()
    }
    ref_opt = make_optimizer(ref.parameters())
    opt = make_optimizer(params.values())
    errors = dict.fromkeys(params, 0.0)
    for step in range(steps):
        ref(*batch(step, 0)).backward()
        for n, p in ref.named_parameters():
            assert p.grad is not None
            params[n].grad = distribute_tensor(p.grad.clone(), mesh, placements[n])
        _step_both(ref, ref_opt, params, opt, errors)
        ref_opt.zero_grad()
    dist.barrier()
    return errors


# Parity workers shared by the optimizer packages' FSDP2 tests: a package passes its optimizer
# factory (e.g. `partial(CAME, backend="torch")`), its named configs and its lazy-variant mutant.

STEPS = 4
TOL = 1e-4  # norm-relative error of every step's update, per tensor
MakeConfigured = Callable[..., torch.optim.Optimizer]
Mutant = Callable[[], AbstractContextManager[object]]


def check_update_errors(errors: dict[str, float], what: str, tol: float = TOL) -> None:
    """Fail, naming `what`, if any tensor's update error is above `tol` (or NaN)."""
    bad = {name: err for name, err in errors.items() if not err <= tol}
    assert not bad, f"{what}: update errors above {tol}: {bad}"


def fsdp_parity_worker(
    rank: int,
    world_size: int,
    optimizer: MakeConfigured,
    configs: Mapping[str, Mapping[str, Any]],
    lazy: Mutant | None,
) -> None:
    """`spawn` worker: sharded steps of every config within `TOL` of the unsharded steps.

    Each of `configs` runs under `Shard(0)` (with a `state_dict` round trip before step 3) and
    under `Replicate`. `lazy`, if given, returns a context manager under which the optimizer
    computes its column statistics from the local rows only; that version must be measurably
    wrong (errors above `100 * TOL` on `lin1.weight` and `lin2.weight` with the first of
    `configs`), so the parity above depends on the all-reduce of the column sums.
    """
    for name, kw in configs.items():
        make = partial(optimizer, **kw)
        errors = fsdp_update_errors(rank, world_size, make, steps=STEPS, resume_at=2)
        check_update_errors(errors, f"{name}, Shard(0), state_dict round trip before step 3")
        replicate = dtensor_update_errors(rank, world_size, make, steps=STEPS)
        check_update_errors(replicate, f"{name}, Replicate")
    if lazy is not None:
        with lazy():
            make = partial(optimizer, **configs[next(iter(configs))])
            errors = fsdp_update_errors(rank, world_size, make, steps=STEPS)
        for name in ("lin1.weight", "lin2.weight"):
            assert errors[name] > 100 * TOL, (
                f"local-only column statistics went unnoticed: {errors}"
            )


def hsdp_parity_worker(
    rank: int, world_size: int, optimizer: MakeConfigured, configs: Mapping[str, Mapping[str, Any]]
) -> None:
    """`spawn` worker (world 4): every config under HSDP on a (2, 2) mesh, within `TOL`."""
    for name, kw in configs.items():
        make = partial(optimizer, **kw)
        errors = fsdp_update_errors(rank, world_size, make, steps=STEPS, mesh_shape=(2, 2))
        check_update_errors(errors, f"{name}, HSDP (Replicate, Shard(0))")


def no_column_reduction(step_work: type) -> AbstractContextManager[object]:
    """The lazy mutant of an optimizer whose steps run on `step_work` (optim-adafactor's StepWork).

    Under it `reduce_factors` reads False: column statistics from the local rows only (no
    all-reduce). Pass `partial(no_column_reduction, StepWork)` as `fsdp_parity_worker`'s `lazy`.
    """
    return patch.object(step_work, "reduce_factors", property(lambda self: False))


def fused_fsdp_worker(rank: int, world_size: int, make_optimizer: MakeOptimizer) -> None:
    """`spawn` worker: 3 `Shard(0)` steps of `make_optimizer` (the fused kernels), within `TOL`.

    The sharded optimizer goes through a `state_dict` round trip before step 3.
    """
    errors = fsdp_update_errors(rank, world_size, make_optimizer, steps=3, resume_at=2)
    check_update_errors(errors, "fused kernels, Shard(0)")


class FsdpParityTests:
    """An optimizer package's FSDP2 tests: subclass it as `TestFsdp2` and set the attributes.

    `optimizer`: the optimizer on its PyTorch path (e.g. `partial(CAME, backend="torch")`);
    `configs`: named keyword arguments for it; `world4`: the config run alone at world size 4;
    `lazy`: the lazy mutant (see `fsdp_parity_worker`); `fused`: the optimizer on its fused
    kernels; `dcp`: the package's `(distributed_state_dict, load_distributed_state_dict)` (a
    tuple, so that the functions are not bound as methods). All go to `spawn`ed workers:
    picklable `functools.partial`s and module-level functions.
    """

    # partials, not functions: a function would be bound as a method
    optimizer: ClassVar[partial[torch.optim.Optimizer]]
    configs: ClassVar[dict[str, dict[str, Any]]]
    world4: ClassVar[str]
    lazy: ClassVar[partial[AbstractContextManager[object]]]
    fused: ClassVar[partial[torch.optim.Optimizer]]
    dcp: ClassVar[tuple[Callable[..., dict[str, Any]], Callable[..., None]]]

    @pytest.mark.distributed
    def test_fully_shard_and_replicate_world2(self, tmp_path: Any) -> None:
        """Every config under `Shard(0)` and `Replicate`; the lazy mutant is caught."""
        args = (self.optimizer, self.configs, self.lazy)
        spawn(fsdp_parity_worker, *args, world_size=2, tmp_path=tmp_path)

    @pytest.mark.distributed
    @pytest.mark.slow  # ~30 s: 4 processes on the 2-core CI machine
    def test_fully_shard_world4(self, tmp_path: Any) -> None:
        """3 rows on 4 ranks: one rank holds none of `lin3.weight`, still joins the reductions."""
        world4 = {self.world4: self.configs[self.world4]}
        spawn(fsdp_parity_worker, self.optimizer, world4, None, world_size=4, tmp_path=tmp_path)

    @pytest.mark.distributed
    @pytest.mark.slow
    def test_fully_shard_world4_all_configs_and_hsdp(self, tmp_path: Any) -> None:
        """Every config at world 4 (with the lazy mutant), then under HSDP on a (2, 2) mesh."""
        args = (self.optimizer, self.configs, self.lazy)
        spawn(fsdp_parity_worker, *args, world_size=4, tmp_path=tmp_path)
        spawn(hsdp_parity_worker, self.optimizer, self.configs, world_size=4, tmp_path=tmp_path)

    @pytest.mark.distributed
    @pytest.mark.interpreter
    @pytest.mark.slow  # the Triton interpreter in 2 processes
    def test_fully_shard_fused_kernels_world2(self, tmp_path: Any) -> None:
        """The fused kernels under `Shard(0)`, with a `state_dict` round trip."""
        spawn(fused_fsdp_worker, self.fused, world_size=2, tmp_path=tmp_path)

    @pytest.mark.distributed
    def test_dcp_checkpoint_reshards_2_to_3_to_1(self, tmp_path: Any) -> None:
        """Every config: DCP checkpoints across 2 -> 3 -> 1 ranks equal one process."""
        for name, kw in self.configs.items():
            check_dcp_chain(partial(self.optimizer, **kw), self.dcp, tmp_path / name, tol=TOL)

    @pytest.mark.distributed
    def test_dcp_bf16_resume_continues_the_rounding_noise(self, tmp_path: Any) -> None:
        """bf16 + stochastic rounding: a DCP resume at world 2 is bit-exact."""
        kw = self.configs[next(iter(self.configs))]
        check_bf16_resume_bit_exact(self.optimizer, kw, self.dcp, tmp_path)

    @pytest.mark.distributed
    @pytest.mark.slow  # 4 processes
    def test_dcp_checkpoint_reshards_through_hsdp(self, tmp_path: Any) -> None:
        """The first config: DCP checkpoints across (2,) -> HSDP (2, 2) -> (1,) meshes."""
        make = partial(self.optimizer, **self.configs[next(iter(self.configs))])
        check_dcp_chain(make, self.dcp, tmp_path, tol=TOL, phases=HSDP_PHASES)
