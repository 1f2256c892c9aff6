"""World 1: shard-zero does no communication, no host reads and no extra gradient copies.

At world 1 nothing is sharded, so a collective, a host read of a device value or a scaling by
1/world is work FSDP2 does not do (`benchmarks/RESULTS.md` §5 counts it). The reduced gradient
is the packed bucket itself, and the compute parameters are the masters cast once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from leanlm_testing.distributed import single_process_group
from shard_zero import ZeroConfig, prepare
from shard_zero._api import engine_of


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
