"""Gradient accumulation, global-norm clipping, memory/communication accounting, checkpoints.

Several checks share one spawned world to amortise process start-up (~5 s per world on CI).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from leanlm_testing import spawn
from leanlm_testing.asserts import update_error
from leanlm_testing.models import random_batches, tiny_llama
from optim_adafactor import Adafactor
from shard_zero import (
    ZeroConfig,
    full_state_dict,
    load_checkpoint,
    memory_stats,
    prepare,
    save_checkpoint,
)

STAGES = (1, 2, 3)


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _batches(n: int, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    return random_batches(256, batches=n, batch_size=8, seq_len=16, seed=seed)


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _reference(steps: int, clip: float | None = None) -> tuple[dict[str, Any], ...]:
    model = tiny_llama(seed=0)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = _adamw(list(model.parameters()))
    norms = []
    for batch in _batches(steps):
        _loss(model, batch["input_ids"]).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return init, final, {"norms": norms}


def _accumulation_and_clip(rank: int, world: int) -> None:
    per = 8 // world
    init, ref, _ = _reference(4)
    _, ref_clip, extra = _reference(4, clip=0.5)
    for stage in STAGES:
        config = ZeroConfig(stage=stage, min_shard_numel=1000, bucket_numel=20000)
        # two micro-batches, the first under no_sync, == the global batch
        model, opt = prepare(tiny_llama(seed=0), _adamw, config)
        for batch in _batches(4):
            ids = batch["input_ids"][rank * per : (rank + 1) * per]
            half = per // 2
            with model.no_sync():
                (_loss(model, ids[:half]) / 2).backward()
            (_loss(model, ids[half:]) / 2).backward()
            opt.step()
            opt.zero_grad()
        err = update_error(init, ref, full_state_dict(model))
        assert err < 1e-4, f"stage {stage} no_sync accumulation: update error {err:.3g}"
        # global-norm clipping == torch.nn.utils.clip_grad_norm_ on the unsharded model
        model, opt = prepare(tiny_llama(seed=0), _adamw, config)
        for step, batch in enumerate(_batches(4)):
            _loss(model, batch["input_ids"][rank * per : (rank + 1) * per]).backward()
            norm = opt.clip_grad_norm_(0.5)
            assert math.isclose(norm.item(), extra["norms"][step].item(), rel_tol=1e-5), (
                stage,
                step,
                norm.item(),
                extra["norms"][step].item(),
            )
            opt.step()
            opt.zero_grad()
        err = update_error(init, ref_clip, full_state_dict(model))
        assert err < 1e-4, f"stage {stage} clipped: update error {err:.3g}"


def _memory_and_comm(rank: int, world: int) -> None:
    for stage in STAGES:
        model, opt = prepare(tiny_llama(seed=0), _adamw, ZeroConfig(stage=stage, min_shard_numel=0))
        psi = sum(p.numel() for p in model.parameters())
        root = sum(p.numel() for n, p in model.named_parameters() if ".layers." not in n)
        batches = _batches(2)
        for batch in batches:
            ids = batch["input_ids"][rank * 8 // world : (rank + 1) * 8 // world]
            _loss(model, ids).backward()
            after_backward = memory_stats(model, opt)
            opt.step()
            after_step = memory_stats(model, opt)
            opt.zero_grad()
        n = world
        params = after_backward["params"] + after_backward["master_params"]
        # stage 1 reduces at the end of backward (full gradients only live until then)
        expected = {
            1: (4 * psi, 4 * psi / n, 8 * psi / n),
            2: (4 * psi, 4 * psi / n, 8 * psi / n),
            3: (4 * psi / n, 4 * psi / n, 8 * psi / n),
        }[stage]
        got = (params, after_backward["grads"], after_step["optimizer_state"])
        for what, g, e in zip(("params", "grads", "optimizer_state"), got, expected, strict=True):
            assert abs(g - e) <= 0.05 * e, f"stage {stage} {what}: {g} bytes vs formula {e:.0f}"
        comm = after_step["communication"]
        moved = sum(kind["bytes"] for kind in comm.values()) / 4  # fp32 elements
        theory = 2 * psi if stage < 3 else 3 * psi - root  # the root unit is gathered once
        assert abs(moved - theory) <= 0.05 * theory, f"stage {stage}: {moved} vs {theory}"
        assert comm["reduce_scatter"]["bytes"] / 4 >= psi
    _mismatch(rank, world)  # shares this world to save a process start-up


def _resume(rank: int, world: int, tmp: str) -> None:
    per = 8 // world
    for stage, make in [(2, _adamw), (3, Adafactor), (1, Adafactor)]:
        config = ZeroConfig(stage=stage, min_shard_numel=1000)

        def train(model: nn.Module, opt: Any, batches: list[dict[str, torch.Tensor]]) -> None:
            for batch in batches:
                _loss(model, batch["input_ids"][rank * per : (rank + 1) * per]).backward()
                opt.step()
                opt.zero_grad()

        batches = _batches(6)
        model, opt = prepare(tiny_llama(seed=0), make, config)
        train(model, opt, batches[:3])
        path = Path(tmp) / f"ckpt-{stage}"
        save_checkpoint(path, model, opt)
        save_checkpoint(path, model, opt)  # overwriting is atomic too
        train(model, opt, batches[3:])
        uninterrupted = full_state_dict(model)
        fresh, fresh_opt = prepare(tiny_llama(seed=1), make, config)  # different init
        load_checkpoint(path, fresh, fresh_opt)
        train(fresh, fresh_opt, batches[3:])
        resumed = full_state_dict(fresh)
        for key, value in uninterrupted.items():
            assert torch.equal(resumed[key], value), f"stage {stage}: {key} differs after resume"
        assert not Path(str(path) + ".tmp").exists()


def _mismatch(rank: int, world: int) -> None:
    model = tiny_llama(seed=0, num_hidden_layers=2 + rank)
    with pytest.raises(ValueError, match="ranks disagree"):
        prepare(model, _adamw, ZeroConfig())
    dist.barrier()


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_accumulation_and_clipping(tmp_path: Path, world: int) -> None:
    spawn(_accumulation_and_clip, world_size=world, tmp_path=tmp_path)


@pytest.mark.distributed
def test_memory_communication_and_mismatch_error(tmp_path: Path) -> None:
    spawn(_memory_and_comm, world_size=2, tmp_path=tmp_path)


@pytest.mark.distributed
def test_checkpoint_resume_is_exact(tmp_path: Path) -> None:
    spawn(_resume, str(tmp_path), world_size=2, tmp_path=tmp_path)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="`stage`"):
        ZeroConfig(stage=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`param_dtype`"):
        ZeroConfig(param_dtype=torch.int8)
    with pytest.raises(ValueError, match="`bucket_numel`"):
        ZeroConfig(bucket_numel=0)
    with pytest.raises(TypeError, match="`min_shard_numel`"):
        ZeroConfig(min_shard_numel=1.5)  # type: ignore[arg-type]


def test_prepare_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        prepare(nn.Linear(2, 2), _adamw)
