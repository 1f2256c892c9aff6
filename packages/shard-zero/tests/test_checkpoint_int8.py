"""Checkpoints of 8-bit optimizer state (CAME and Adafactor `state_dtype=torch.int8`).

Their first moment is int8 codes shaped like the parameter plus `exp_avg_scale` (rows x blocks),
so with even row shards every saved rank holds a scale of the same shape whose dim 0 is also the
row count: the loader must still slice it by rows. A world-2 run saves, then loads at worlds 1, 2
and 4 and into a plain model: every rank's loaded state is bit-equal to its rows of the saved
state (whole tensors whole), and at world 2 training continues bit-equal to the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from leanlm_testing import spawn
from leanlm_testing.models import random_batches, tiny_llama
from leanlm_testing.reshard import train_rank_share
from optim_adafactor import Adafactor
from optim_came import CAME
from shard_zero import ZeroConfig, full_state_dict, load_checkpoint, prepare, save_checkpoint

OPTIMIZERS = {
    "came-int8": lambda ps: CAME(ps, lr=1e-3, state_dtype=torch.int8),
    "adafactor-int8": lambda ps: Adafactor(
        ps, lr=1e-3, relative_step=False, beta1=0.9, state_dtype=torch.int8
    ),
}
WHOLE = {"exp_avg_sq_col", "exp_avg_res_col"}  # column statistics: every rank holds all of them
STEPS = 2


def _batches() -> list[dict[str, torch.Tensor]]:
    return random_batches(256, batches=2 * STEPS, batch_size=4, seq_len=16)


def _prepare(name: str, stage: int) -> tuple[Any, Any]:
    config = ZeroConfig(stage=stage, min_shard_numel=100)  # type: ignore[arg-type]
    return prepare(tiny_llama(seed=7).train(), OPTIMIZERS[name], config)


def _state_rows(model: Any, opt: Any) -> dict[str, tuple[int, int, dict[str, Any]]]:
    """Per parameter name: this rank's (first row, end row, optimizer state)."""
    engine = model._shard_zero_engine
    out = {}
    for e in engine.entries:
        state = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[e.master].items()}
        start, end = (e.start, e.end) if e.sharded else (0, e.rows)
        out[e.name] = (start, end, state)
    return out


def _save(rank: int, world: int, tmp: str) -> None:
    for name in OPTIMIZERS:
        model, opt = _prepare(name, stage=2)
        train_rank_share(model, opt, rank, world, _batches()[:STEPS])
        save_checkpoint(Path(tmp) / name, model, opt)
        torch.save(_state_rows(model, opt), Path(tmp) / f"{name}-rows-{rank}.pt")
        assert any(s["exp_avg"].dtype == torch.int8 for _, _, s in _state_rows(model, opt).values())
        train_rank_share(model, opt, rank, world, _batches()[STEPS:])
        after = full_state_dict(model)
        if rank == 0:
            torch.save(after, Path(tmp) / f"{name}-after.sd")


def _saved_full(tmp: Path, name: str) -> dict[str, dict[str, Any]]:
    """The saved optimizer state of every parameter, its row-sliced tensors put back together."""
    ranks = [torch.load(f, weights_only=True) for f in sorted(tmp.glob(f"{name}-rows-*.pt"))]
    full: dict[str, dict[str, Any]] = {}
    for param in ranks[0]:
        pieces = sorted((r[param] for r in ranks), key=lambda piece: piece[0])
        state = dict(pieces[0][2])
        sliced = len({piece[0] for piece in pieces}) > 1  # sharded: one row range per rank
        for key, value in state.items():
            if sliced and torch.is_tensor(value) and value.dim() > 0 and key not in WHOLE:
                state[key] = torch.cat([p[2][key] for p in pieces])
        full[param] = state
    return full


def _check_loaded(model: Any, opt: Any, full: dict[str, dict[str, Any]], where: str) -> None:
    engine = getattr(model, "_shard_zero_engine", None)
    entries = (
        [
            (e.name, e.master, *((e.start, e.end) if e.sharded else (0, e.rows)))
            for e in engine.entries
        ]
        if engine is not None
        else [(n, p, 0, p.shape[0] if p.dim() else 1) for n, p in model.named_parameters()]
    )
    for param, master, start, end in entries:
        state = opt.state[master]
        assert set(state) == set(full[param]), (where, param)
        for key, saved in full[param].items():
            got = state[key]
            sliced = torch.is_tensor(saved) and saved.dim() > 0 and key not in WHOLE
            want = saved[start:end] if sliced else saved
            if torch.is_tensor(want):
                assert got.dtype == want.dtype, (where, param, key)
                assert torch.equal(got.cpu(), want), (where, param, key)
            else:
                assert got == want, (where, param, key)


def _load(rank: int, world: int, tmp: str, stage: int) -> None:
    for name in OPTIMIZERS:
        model, opt = _prepare(name, stage=stage)
        load_checkpoint(Path(tmp) / name, model, opt)
        _check_loaded(model, opt, _saved_full(Path(tmp), name), f"{name} world {world}")
        if world == 2:  # the saving world size: the resumed run continues bit-equal
            train_rank_share(model, opt, rank, world, _batches()[STEPS:])
            got = full_state_dict(model)
            want = torch.load(Path(tmp) / f"{name}-after.sd", weights_only=True)
            for key, value in want.items():
                assert torch.equal(got[key], value), (name, key)


@pytest.mark.distributed
def test_int8_state_loads_at_every_world_size_and_into_a_plain_model(tmp_path: Path) -> None:
    spawn(_save, str(tmp_path), world_size=2, tmp_path=tmp_path)
    for world, stage in ((2, 2), (1, 3), (4, 3)):
        spawn(_load, str(tmp_path), stage, world_size=world, tmp_path=tmp_path)
    for name, make in OPTIMIZERS.items():  # no process group: all rows, as one process
        model = tiny_llama(seed=7).train()
        opt = make(list(model.parameters()))
        load_checkpoint(tmp_path / name, model, opt)
        _check_loaded(model, opt, _saved_full(tmp_path, name), f"{name} plain")
