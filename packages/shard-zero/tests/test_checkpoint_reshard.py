"""Checkpoints: N -> M resharding keeps factored statistics right; each rank reads only its rows.

One chain of world sizes 1 -> 2 -> 4 -> 2 -> 1 (covering 1->2, 2->4, 4->2, 2->1) trains a few
steps per phase with Adafactor and CAME, saves, and the next phase loads at the new world size
and continues. The end result must equal one uninterrupted single-process run, and every load
records what it read from the files (safetensors slices) to show a rank never materialises
another rank's shard. The world-4 checkpoint also loads into a plain (unprepared) model and
optimizer, whose own checkpoint (a world-1 one) loads back at world 2: like one process.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shard_zero
import shard_zero._checkpoint as ckpt_module
from leanlm_testing import spawn
from leanlm_testing.models import random_batches, tiny_llama
from leanlm_testing.reshard import (
    Read,
    assert_like_one_process,
    recording_safe_open,
    reshard_phase,
    spawn_chain,
    train_rank_share,
)
from optim_adafactor import Adafactor
from optim_came import CAME
from shard_zero import load_checkpoint, save_checkpoint

OPTIMIZERS = {
    "adafactor": lambda params: Adafactor(params, beta1=0.9, weight_decay=0.1),
    "came": lambda params: CAME(params, lr=1e-3),
}
CHAIN = [(1, 3), (2, 2), (4, 3), (2, 1), (1, 2)]  # (world size, stage) per phase
STEPS = 2  # per phase
GLOBAL_BATCH = 8


def _batches() -> list[dict[str, torch.Tensor]]:
    return random_batches(256, batches=STEPS * len(CHAIN), batch_size=GLOBAL_BATCH, seq_len=16)


def _check_reads(reads: list[Read], model: nn.Module, tmp: Path) -> None:
    """Every row read overlaps this rank's rows; whole reads are replicated (small) tensors."""
    engine = model._shard_zero_engine  # type: ignore[attr-defined]
    by_name = {e.name: e for e in engine.entries}
    saved_rows: dict[str, dict[str, list[int]]] = {}
    for f in tmp.glob("rank*.safetensors"):
        with ckpt_module.safe_open(f, framework="pt") as h:
            saved_rows[f.name] = json.loads(h.metadata()["shard_zero"])["rows"]
    master_read = dict.fromkeys(by_name, 0)
    for file, key, rows, numel in reads:
        name, _, what = key.partition("::")
        e = by_name[name]
        if rows is None:  # a whole tensor: replicated parameters or whole (column) statistics
            assert what != "master" or not e.sharded, f"{key}: whole sharded master read"
            if e.sharded:
                assert numel <= max(1, math.prod(e.shape[1:])), f"{key}: {numel} elements"
        else:
            lo = saved_rows[file][name][0] + rows[0]
            hi = saved_rows[file][name][0] + rows[1]
            mine = (e.start, e.end) if e.sharded else (0, e.rows)
            assert mine[0] <= lo <= hi <= mine[1], f"{key}: read rows {lo}:{hi} outside {mine}"
        if what == "master":
            master_read[name] += numel
    for name, e in by_name.items():
        assert master_read[name] == e.master.numel(), f"{name}: read {master_read[name]} elements"


def _load_recording_reads(path: Path, model: nn.Module, opt: Any) -> None:
    with recording_safe_open(ckpt_module) as reads:
        load_checkpoint(path, model, opt)
    _check_reads(reads, model, path)


def _phase(rank: int, world: int, phase: int, stage: int, tmp: str) -> None:
    torch.manual_seed(0)
    batches = _batches()[phase * STEPS : (phase + 1) * STEPS]
    reshard_phase(
        shard_zero,
        rank,
        world,
        phase,
        stage,
        tmp=tmp,
        optimizers=OPTIMIZERS,
        batches=batches,
        load=_load_recording_reads,
    )


@pytest.mark.distributed
def test_factored_state_reshards_1_2_4_2_1_and_reads_only_own_rows(tmp_path: Path) -> None:
    spawn_chain(_phase, CHAIN, tmp_path)
    last = len(CHAIN) - 1
    assert_like_one_process(
        OPTIMIZERS, _batches(), lambda name: tmp_path / f"{name}-{last}.sd", "1->2->4->2->1"
    )
    # The world-4 ZeRO-3 checkpoint of phase 2 into a plain model and optimizer, in this process
    # (no process group): the weights as saved; it trains phase 3 and saves a plain (world-1)
    # checkpoint, which phase 4 loads at world 2, ZeRO-3: like one process at the end.
    plain = tmp_path / "plain"
    plain.mkdir()
    for name, make in OPTIMIZERS.items():
        model = tiny_llama(seed=7).train()
        opt = make(list(model.parameters()))
        load_checkpoint(tmp_path / f"{name}-2", model, opt)
        saved = torch.load(tmp_path / f"{name}-2.sd", weights_only=True)
        for key, value in model.state_dict().items():
            assert torch.equal(value, saved[key]), f"{name}: {key} differs after a plain load"
        assert all(opt.state[p] for p in model.parameters()), f"{name}: optimizer state missing"
        train_rank_share(model, opt, 0, 1, _batches()[3 * STEPS : 4 * STEPS])
        save_checkpoint(plain / f"{name}-3", model, opt)
        torch.save(model.state_dict(), plain / f"{name}-3.sd")
    spawn(_phase, 4, 3, str(plain), world_size=2, tmp_path=tmp_path)
    assert_like_one_process(
        OPTIMIZERS, _batches(), lambda name: plain / f"{name}-4.sd", "1->2->4->plain->2"
    )
