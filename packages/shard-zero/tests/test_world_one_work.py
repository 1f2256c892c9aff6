"""No work FSDP2 does not do: no extra gradient or parameter copies, at world 1 and 2.

At world 1 nothing is sharded, so a collective, a host read of a device value or a scaling by
1/world is work FSDP2 does not do (`benchmarks/RESULTS.md` §5 counts it). The reduced gradient
is the packed bucket itself, and the compute parameters are the masters cast once (stage 3:
straight into the gathered unit). At world 2 an fp32 reduce-scatter averages in the collective,
so the master gradients are its output (no scaling pass), and an all-gather runs in place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from leanlm_testing import spawn
from leanlm_testing.distributed import single_process_group
from shard_zero import ZeroConfig, prepare
from shard_zero._api import engine_of
from shard_zero._comm import Gather


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_world_one_step_communicates_nothing_and_reads_nothing(
    tmp_path: Path, stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(4, 16)
    with single_process_group("cpu", tmp_path):
        config = ZeroConfig(stage=stage, min_shard_numel=0, param_dtype=torch.bfloat16)  # type: ignore[arg-type]
        model, opt = prepare(_model(), _adamw, config)
        engine = engine_of(model)
        reads: list[str] = []
        real = torch.Tensor.tolist

        def tolist(t: torch.Tensor) -> Any:
            reads.append("tolist")
            return real(t)

        monkeypatch.setattr(torch.Tensor, "tolist", tolist)
        for _ in range(2):
            model(x.bfloat16()).float().square().mean().backward()
            if stage == 2:  # the master gradients are the packed buckets themselves
                for e in engine.sharded:
                    g = e.master.grad
                    assert g is not None
                    assert g.dtype == torch.float32
                    assert g._base is not None, e.name  # a view: no copy of the bucket
            opt.step()
            assert engine.comm.last_step == {}, engine.comm.last_step  # no collective at all
            for e in engine.sharded:  # stages 1-2: the parameter is its master, cast once
                if stage < 3:
                    assert torch.equal(e.param.data, e.master.detach().bfloat16()), e.name
            opt.zero_grad()
        assert reads == []  # no host read of a tensor (a device sync on a GPU)


def test_world_one_gradients_are_the_compute_gradients_exactly(tmp_path: Path) -> None:
    """The fp32 master gradient equals the bf16 compute gradient, value for value."""
    x = torch.randn(4, 16)
    ref = _model().bfloat16()
    ref(x.bfloat16()).float().square().mean().backward()
    with single_process_group("cpu", tmp_path):
        config = ZeroConfig(stage=2, min_shard_numel=0, param_dtype=torch.bfloat16)
        model, _ = prepare(_model(), _adamw, config)
        model(x.bfloat16()).float().square().mean().backward()
        engine = engine_of(model)
        for (name, p), e in zip(ref.named_parameters(), engine.entries, strict=True):
            assert e.master.grad is not None
            assert p.grad is not None
            assert torch.equal(e.master.grad, p.grad.float()), name


def test_world_one_stage_three_casts_the_masters_into_the_unit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No all-gather payload at world 1: the gathered parameters are the masters cast once."""
    x = torch.randn(4, 16)

    def no_payload(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a stage-3 gather at world 1 built an all-gather payload")

    monkeypatch.setattr("shard_zero._units.Gather", no_payload)
    with single_process_group("cpu", tmp_path):
        config = ZeroConfig(stage=3, min_shard_numel=0, param_dtype=torch.bfloat16)
        model, opt = prepare(_model(), _adamw, config)
        engine = engine_of(model)
        seen: list[tuple[str, torch.Tensor, torch.Tensor]] = []

        def record(module: nn.Module, args: Any) -> None:
            for e in engine.sharded:
                seen.append((e.name, e.param.detach().clone(), e.master.detach().bfloat16()))

        model[0].register_forward_pre_hook(record)
        for _ in range(2):  # the second forward gathers the stepped masters
            model(x.bfloat16()).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert len(seen) == 2 * len(engine.sharded)
        for name, gathered, cast in seen:
            assert torch.equal(gathered, cast), name


def _reduce_and_gather_in_place(rank: int, world: int) -> None:
    xs = torch.randn(world, 4, 16, generator=torch.Generator().manual_seed(1))
    ref = _model()
    local = []
    for x in xs:  # every rank's gradient, in one process
        ref.zero_grad()
        ref(x).square().mean().backward()
        local.append([p.grad.clone() for p in ref.parameters() if p.grad is not None])
    mean = [(a + b) / world for a, b in zip(*local, strict=True)]  # the sum of 2, divided
    for stage in (2, 3):
        model, _ = prepare(_model(), _adamw, ZeroConfig(stage=stage, min_shard_numel=0))
        model(xs[rank]).square().mean().backward()
        engine = engine_of(model)
        for e, want in zip(engine.entries, mean, strict=True):
            g = e.master.grad
            assert g is not None, e.name
            assert g._base is not None, e.name  # the reduce-scatter output: no scaling pass
            assert torch.equal(g, want[e.start : e.end]), (stage, e.name)
        # an all-gather's input is this rank's row of its output (in place, as FSDP2's)
        gather = Gather(engine.comm, ident=7, size=5, dtype=torch.bfloat16)
        assert gather.payload.untyped_storage()._cdata == gather.out.untyped_storage()._cdata
        gather.payload.copy_(torch.arange(5) + 10 * rank)
        out = gather.start().wait()
        assert torch.equal(out, torch.arange(5) + 10 * torch.arange(world)[:, None])


@pytest.mark.distributed
def test_world_two_averages_in_the_reduce_scatter_and_gathers_in_place(tmp_path: Path) -> None:
    spawn(_reduce_and_gather_in_place, world_size=2, tmp_path=tmp_path)
