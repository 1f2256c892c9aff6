"""GradualPruning under sharding engines: ZeRO-3 placeholders (simulated) and FSDP2 (real)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from leanlm_testing import spawn
from sparse_kernels import GradualPruning, masks
from sparse_kernels.sparsify import stored_weight


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.ModuleList([nn.Linear(16, 15), nn.Linear(15, 16)]))


def _schedule(model: nn.Module) -> GradualPruning:
    return GradualPruning(model, final_sparsity=0.5, end_step=2, frequency=1)


def _placeholder(param: torch.Tensor) -> torch.Tensor:
    """What shard-zero's stage 3 leaves in a parameter outside forward: a stride-0 NaN view."""
    return torch.full((1,), float("nan"), dtype=param.dtype).expand(param.shape)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("which", [[0, 1], [1]], ids=["all", "second"])
def test_placeholder_weights_raise_and_change_nothing(which):
    model = _model()
    sched = _schedule(model)
    ref = copy.deepcopy(model)
    ref_sched = _schedule(ref)
    before = _snapshot(model)
    layers = model[0]
    real = {i: stored_weight(layers[i]).data for i in which}
    for i in which:
        stored_weight(layers[i]).data = _placeholder(real[i])
    first = f"0.{which[0]}"
    message = (
        f"GradualPruning: cannot re-mask {first} at step 1: its weight is a stride-0 view "
        f"(0, 0) of its shape {tuple(real[which[0]].shape)}, not the full trained values"
    )
    with pytest.raises(RuntimeError, match=re.escape(message)) as err:
        sched.step()
    assert "shard_zero.gathered(model, writeback=True)" in str(err.value)
    assert "Nothing was changed" in str(err.value)
    # before: 0.0's mask was rebuilt from NaN, then torch's "more than one element" error
    assert sched.step_count == 0
    for i in which:
        stored_weight(layers[i]).data = real[i]
    after = _snapshot(model)
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    # the full weights back (what `gathered(..., writeback=True)` gives): the same step as ever
    sched.step()
    ref_sched.step()
    assert sched.step_count == 1
    for key, value in _snapshot(ref).items():
        assert torch.equal(_snapshot(model)[key], value), key
    assert all(float(m.float().mean()) < 1.0 for m in masks(model).values())


def test_nan_weights_raise_and_change_nothing():
    model = _model()
    sched = _schedule(model)
    with torch.no_grad():
        stored_weight(model[0][1])[3, 4] = float("inf")
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match=r"cannot re-mask 0\.1 at step 1: its weight holds NaN"):
        sched.step()
    assert sched.step_count == 0
    for key, value in _snapshot(model).items():
        assert torch.equal(before[key], value), key


def test_an_empty_placeholder_raises_and_changes_nothing():
    """DeepSpeed's stage 3 leaves an empty tensor in a parameter outside forward."""
    placeholder, why = torch.empty(0), "has shape (0,), not the Linear's (16, 15)"
    model = _model()
    sched = _schedule(model)
    before = _snapshot(model)
    real = stored_weight(model[0][1]).data
    stored_weight(model[0][1]).data = placeholder
    with pytest.raises(
        RuntimeError, match=re.escape(f"cannot re-mask 0.1 at step 1: its weight {why}")
    ):
        sched.step()
    assert sched.step_count == 0
    stored_weight(model[0][1]).data = real
    for key, value in _snapshot(model).items():
        assert torch.equal(before[key], value), key


def _fsdp2_worker(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world_size,))
    ref = _model()
    ref_sched = GradualPruning(ref, final_sparsity=0.5, end_step=4, frequency=2)
    net = _model()
    sched = GradualPruning(net, final_sparsity=0.5, end_step=4, frequency=2)
    for layer in net[0]:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    assert isinstance(stored_weight(net[0][0]), DTensor)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)

    def run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m[0][1](torch.relu(m[0][0](x)))

    for step in range(5):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))  # same on all ranks
        run(ref, x).square().mean().backward()
        run(net, x).square().mean().backward()
        for o, s in ((ref_opt, ref_sched), (opt, sched)):
            o.step()
            o.zero_grad()
            s.step()
    got = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
        for k, v in net.state_dict().items()
    }
    if rank == 0:
        torch.save({"ref": _snapshot(ref), "got": got, "steps": sched.step_count}, path)
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2])
def test_gradual_pruning_under_fsdp2_matches_one_process(tmp_path, world_size):
    path = str(tmp_path / "out.pt")
    spawn(_fsdp2_worker, path, world_size=world_size, tmp_path=tmp_path)
    out = torch.load(path)
    ref, got = out["ref"], out["got"]
    assert out["steps"] == 5
    assert ref.keys() == got.keys()
    mask_keys = [k for k in ref if k.endswith(".mask")]
    assert len(mask_keys) == 2
    for key in mask_keys:  # before: "mixed torch.Tensor and DTensor" at the first step()
        assert torch.equal(ref[key], got[key]), key
        assert float(ref[key].float().mean()) == 0.5
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-6, atol=1e-7, msg=key)
