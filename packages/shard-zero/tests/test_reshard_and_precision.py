"""Checkpoints across world sizes (2 -> 4 -> 1) and bf16 mixed precision against fp32."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import shard_zero
from leanlm_testing import spawn
from leanlm_testing.models import random_batches, tiny_llama
from leanlm_testing.reshard import (
    assert_like_one_process,
    reshard_phase,
    spawn_chain,
    train_rank_share,
)
from optim_adafactor import Adafactor
from shard_zero import ZeroConfig, full_state_dict, prepare

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adafactor": lambda params: Adafactor(params, beta1=0.9),
}
PHASES = 3  # steps per world size
BF16_VS_RECIPE = 0.2


def _batches() -> list[dict[str, torch.Tensor]]:
    return random_batches(256, batches=3 * PHASES, batch_size=8, seq_len=16, seed=5)


def _phase(rank: int, world: int, phase: int, stage: int, tmp: str) -> None:
    batches = _batches()[phase * PHASES : (phase + 1) * PHASES]
    reshard_phase(
        shard_zero, rank, world, phase, stage, tmp=tmp, optimizers=OPTIMIZERS, batches=batches
    )


@pytest.mark.distributed
def test_checkpoint_reshards_across_world_sizes(tmp_path: Path) -> None:
    spawn_chain(_phase, [(2, 2), (4, 3), (1, 1)], tmp_path)
    assert_like_one_process(
        OPTIMIZERS, _batches(), lambda name: tmp_path / f"{name}-2.sd", "2 -> 4 -> 1 ranks"
    )


def _single_process(dtype: torch.dtype, batches: list[Any]) -> dict[str, torch.Tensor]:
    """The same recipe in one process: `dtype` compute weights, fp32 masters, grads and AdamW."""
    model = tiny_llama(seed=0)
    masters = [p.detach().clone().float().requires_grad_() for p in model.parameters()]
    model.to(dtype)
    opt = OPTIMIZERS["adamw"](masters)
    for batch in batches:
        model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss.backward()
        for p, master in zip(model.parameters(), masters, strict=True):
            master.grad, p.grad = p.grad.float(), None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, master in zip(model.parameters(), masters, strict=True):
                p.copy_(master)
    names = [n for n, _ in model.named_parameters()]
    return dict(zip(names, [m.detach() for m in masters], strict=True))


def _worst(init: dict[str, Any], ref: dict[str, Any], got: dict[str, Any]) -> float:
    worst = 0.0
    for key, final in ref.items():
        d_ref = (final - init[key]).double()
        err = (got[key].double() - init[key].double() - d_ref).norm() / d_ref.norm()
        worst = max(worst, float(err))
    return worst


def _mixed(rank: int, world: int, tmp: str) -> None:
    batches = random_batches(256, batches=10, batch_size=8, seq_len=16, seed=7)
    init = {k: v.detach().clone() for k, v in tiny_llama(seed=0).named_parameters()}
    ref32 = _single_process(torch.float32, batches)
    ref16 = _single_process(torch.bfloat16, batches)
    errors = {}
    for stage in (2, 3):
        for reduce_dtype in (None, torch.bfloat16):
            config = ZeroConfig(
                stage=stage,  # type: ignore[arg-type]
                param_dtype=torch.bfloat16,
                reduce_dtype=reduce_dtype,
                min_shard_numel=100,
            )
            model, opt = prepare(tiny_llama(seed=0), OPTIMIZERS["adamw"], config)
            train_rank_share(model, opt, rank, world, batches[:1])
            assert all(p.dtype == torch.bfloat16 for p in model.parameters())
            for p in opt.param_groups[0]["params"]:
                assert p.dtype == torch.float32
                assert p.grad is None or p.grad.dtype == torch.float32
            train_rank_share(model, opt, rank, world, batches[1:])
            got = full_state_dict(model)
            errors[stage, reduce_dtype] = (_worst(init, ref16, got), _worst(init, ref32, got))
    floor = _worst(init, ref32, ref16)  # what bf16 compute alone costs, in one process
    if os.environ.get("SHARD_ZERO_PRINT"):
        print(floor, errors, flush=True)
    for key, (vs_bf16, vs_fp32) in errors.items():
        assert vs_bf16 < BF16_VS_RECIPE, f"{key}: {vs_bf16:.3g} vs the single-process bf16 recipe"
        assert vs_fp32 < 1.5 * floor, f"{key}: {vs_fp32:.3g} vs fp32 (bf16 floor {floor:.3g})"


@pytest.mark.distributed
def test_bf16_mixed_precision_tracks_fp32(tmp_path: Path) -> None:
    spawn(_mixed, str(tmp_path), world_size=2, tmp_path=tmp_path)
