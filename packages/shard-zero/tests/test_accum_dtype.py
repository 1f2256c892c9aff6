"""The sharded gradient accumulator's options: `accum_dtype=torch.bfloat16` and `offload_accum`.

bf16:

At world 2, stages 2 and 3, an engine with the bf16 accumulator runs beside one with the default
fp32 accumulator on the same micro-batches. Between micro-batches its sharded gradients are bf16
(half the bytes) and, in the first step, equal the fp32 ones rounded; after the boundary
backward the optimizer reads fp32 gradients again, within a few bf16 roundings of the fp32 run,
and the trained weights stay near the single-process result (measurably less near than fp32's:
the rounding is real).

Offload: at world 2, stages 2 and 3, engines with `offload_accum` (fp32 and bf16 accumulators)
run beside the on-device ones. Between micro-batches the offloaded engines hold no gradient on
the device (`master.grad`, `low_acc` and the `grads` bytes are empty) and their host buffers
equal the on-device accumulators bit for bit (scaling by 1/2 is exact, and the sum is the same);
the boundary gradients, and so the trained weights, are bit-identical for fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from leanlm_testing import spawn
from leanlm_testing.asserts import update_error
from leanlm_testing.models import random_batches, tiny_llama
from shard_zero import ZeroConfig, full_state_dict, memory_stats, prepare
from shard_zero._api import engine_of

BF16_EPS = 2.0**-7  # bf16 machine epsilon (7 stored significand bits): rounding <= half of it


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _batches() -> list[torch.Tensor]:
    return [b["input_ids"] for b in random_batches(256, batches=3, batch_size=12, seq_len=16)]


def _sharded_grads(model: nn.Module, low: bool) -> list[torch.Tensor]:
    engine = engine_of(model)
    return [(e.low_acc if low else e.master.grad) for e in engine.sharded]  # type: ignore[misc]


def _micro_batches(
    models: list[nn.Module], ids: torch.Tensor, rank: int, world: int
) -> Iterator[int]:
    """Run this rank's 3 micro-batches of `ids` through every model, the first two under
    `no_sync()`; yields the index of each micro-batch that is followed by another."""
    per = ids.shape[0] // world
    mine = ids[rank * per : (rank + 1) * per].chunk(3)
    for i, micro in enumerate(mine):
        last = i == len(mine) - 1
        for model in models:
            with contextlib.nullcontext() if last else model.no_sync():  # type: ignore[operator]
                (_loss(model, micro) / 3).backward()
        if not last:
            yield i


def _close_in_bf16(got: torch.Tensor, ref: torch.Tensor, roundings: int) -> None:
    """Within `roundings` bf16 roundings of `ref`, in norm (a sum may cancel elementwise)."""
    if roundings == 1:  # one rounding: elementwise, round-to-nearest (half an ulp)
        bound = BF16_EPS / 2 * ref.double().abs()
        assert bool(((got.double() - ref.double()).abs() <= bound).all())
    err = float((got.double() - ref.double()).norm())
    assert err <= roundings * BF16_EPS * float(ref.double().norm()), (err, roundings)


def _reference() -> tuple[dict[str, Any], dict[str, Any]]:
    model = tiny_llama(seed=0)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = _adamw(list(model.parameters()))
    for ids in _batches():
        _loss(model, ids).backward()
        opt.step()
        opt.zero_grad()
    return init, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(rank: int, world: int) -> None:
    init, ref = _reference()
    for stage in (2, 3):
        runs = {}
        for low in (False, True):
            config = ZeroConfig(
                stage=stage,
                min_shard_numel=0,
                bucket_numel=5000,  # several buckets, some parameters in pieces
                accum_dtype=torch.bfloat16 if low else None,
            )
            runs[low] = prepare(tiny_llama(seed=0), _adamw, config)
        for step, ids in enumerate(_batches()):
            for i in _micro_batches([m for m, _ in runs.values()], ids, rank, world):
                # between micro-batches: bf16 accumulators, the fp32 ones rounded
                fp32, bf16 = (_sharded_grads(runs[low][0], low) for low in (False, True))
                assert all(g.dtype == torch.bfloat16 for g in bf16)
                for e in engine_of(runs[True][0]).sharded:
                    assert e.master.grad is None, "bf16 mode must not also hold fp32 gradients"
                for g, r in zip(bf16, fp32, strict=True):
                    if step == 0:  # later steps start from weights that differ
                        _close_in_bf16(g, r, roundings=i + 1)
                grads = [memory_stats(m, o)["grads"] for m, o in (runs[False], runs[True])]
                assert grads[1] == grads[0] // 2, (stage, grads)
            # after the boundary backward the optimizer reads fp32 gradients
            fp32 = _sharded_grads(runs[False][0], False)
            got = [e.master.grad for e in engine_of(runs[True][0]).sharded]
            assert all(e.low_acc is None for e in engine_of(runs[True][0]).sharded)
            assert all(g is not None and g.dtype == torch.float32 for g in got)
            for g, r in zip(got, fp32, strict=True):
                if step == 0:
                    _close_in_bf16(g, r, roundings=3)  # type: ignore[arg-type]
            differs = any(not torch.equal(g, r) for g, r in zip(got, fp32, strict=True))
            assert differs, f"stage {stage} step {step}: bf16 accumulation left no rounding"
            for _, opt in runs.values():
                opt.step()
                opt.zero_grad()
        err = {low: update_error(init, ref, full_state_dict(m)) for low, (m, _) in runs.items()}
        assert err[False] < 1e-4, (stage, err)
        assert err[False] < err[True] < 5e-2, (stage, err)


@pytest.mark.distributed
def test_bf16_accumulator_is_half_the_bytes_and_close_to_fp32(tmp_path: Path) -> None:
    spawn(_run, world_size=2, tmp_path=tmp_path)


def test_accum_dtype_is_validated() -> None:
    with pytest.raises(ValueError, match=r"`accum_dtype`.*stages 2-3 only"):
        ZeroConfig(stage=1, accum_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"`accum_dtype` \(torch.float16\)"):
        ZeroConfig(stage=3, accum_dtype=torch.float16)
    with pytest.raises(ValueError, match="`accum_dtype`"):
        ZeroConfig(stage=2, accum_dtype=torch.int8)
    assert ZeroConfig(stage=1, accum_dtype=torch.float32).accum_dtype == torch.float32


def _run_offload(rank: int, world: int) -> None:
    for stage in (2, 3):
        kinds = [(False, False), (True, False), (False, True), (True, True)]  # (offload, low)
        runs = {
            kind: prepare(
                tiny_llama(seed=0),
                _adamw,
                ZeroConfig(
                    stage=stage,
                    min_shard_numel=0,
                    bucket_numel=5000,
                    accum_dtype=torch.bfloat16 if kind[1] else None,
                    offload_accum=kind[0],
                ),
            )
            for kind in kinds
        }
        engines = {kind: engine_of(model) for kind, (model, _) in runs.items()}
        for step, ids in enumerate(_batches()[:2]):
            for _ in _micro_batches([m for m, _ in runs.values()], ids, rank, world):
                for low in (False, True):
                    on_device, offloaded = engines[False, low], engines[True, low]
                    stats = memory_stats(*runs[True, low])
                    assert stats["grads"] == 0, (stage, low, stats)
                    device_stats = memory_stats(*runs[False, low])
                    assert stats["host_grads"] == device_stats["grads"] > 0
                    for e, d in zip(offloaded.sharded, on_device.sharded, strict=True):
                        assert e.master.grad is None
                        assert e.low_acc is None
                        assert e.host_has
                        assert e.host_acc is not None
                        acc = d.low_acc if low else d.master.grad
                        assert acc is not None
                        if step == 0 or not low:  # bf16 weights differ after the first step
                            assert torch.equal(e.host_acc, acc), (stage, e.name, low)
            for low in (False, True):
                pairs = zip(engines[True, low].sharded, engines[False, low].sharded, strict=True)
                for e, d in pairs:
                    assert not e.host_has
                    assert e.master.grad is not None
                    assert d.master.grad is not None
                    if low and step == 0:  # the last micro-batch is added in fp32
                        _close_in_bf16(e.master.grad, d.master.grad, roundings=3)
                    elif not low:
                        assert torch.equal(e.master.grad, d.master.grad), (stage, e.name)
            for _, opt in runs.values():
                opt.step()
                opt.zero_grad()
        weights = {kind: full_state_dict(model) for kind, (model, _) in runs.items()}
        for key, value in weights[False, False].items():
            assert torch.equal(weights[True, False][key], value), (stage, key)
        # zero_grad() drops what the host holds: the next step starts from zero
        model, opt = runs[True, False]
        with model.no_sync():
            _loss(model, _batches()[0][rank::world]).backward()
        assert any(e.host_has for e in engines[True, False].sharded)
        opt.zero_grad()
        assert not any(e.host_has for e in engines[True, False].sharded)


@pytest.mark.distributed
def test_offloaded_accumulator_holds_no_device_gradient_and_is_exact(tmp_path: Path) -> None:
    spawn(_run_offload, world_size=2, tmp_path=tmp_path)


def test_offload_accum_is_validated() -> None:
    with pytest.raises(ValueError, match=r"`offload_accum` \(True\).*stages 2-3 only"):
        ZeroConfig(stage=1, offload_accum=True)
    with pytest.raises(TypeError, match="`offload_accum`"):
        ZeroConfig(stage=2, offload_accum="yes")  # type: ignore[arg-type]
