"""Checkpoints: N -> M resharding keeps factored statistics right; each rank reads only its rows.

One chain of world sizes 1 -> 2 -> 4 -> 2 -> 1 (covering 1->2, 2->4, 4->2, 2->1) trains a few
steps per phase with Adafactor and CAME, saves, and the next phase loads at the new world size
and continues. The end result must equal one uninterrupted single-process run, and every load
records what it read from the files (safetensors slices) to show a rank never materialises
another rank's shard.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shard_zero._checkpoint as ckpt_module
from leanlm_testing import spawn
from leanlm_testing.models import random_batches, tiny_llama
from optim_adafactor import Adafactor
from optim_came import CAME
from shard_zero import ZeroConfig, full_state_dict, load_checkpoint, prepare, save_checkpoint

OPTIMIZERS = {
    "adafactor": lambda params: Adafactor(params, beta1=0.9, weight_decay=0.1),
    "came": lambda params: CAME(params, lr=1e-3),
}
CHAIN = [(1, 3), (2, 2), (4, 3), (2, 1), (1, 2)]  # (world size, stage) per phase
STEPS = 2  # per phase
GLOBAL_BATCH = 8


def _batches() -> list[dict[str, torch.Tensor]]:
    return random_batches(256, batches=STEPS * len(CHAIN), batch_size=GLOBAL_BATCH, seq_len=16)


class _Recorder:
    """Wraps `safe_open`: records every tensor read as (file, key, rows read or None, numel)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.reads: list[tuple[str, str, tuple[int, int] | None, int]] = []

    def __call__(self, path: Any, **kwargs: Any) -> Any:
        recorder, handle = self, self.real(path, **kwargs)
        name = Path(path).name

        class Slice:
            def __init__(self, key: str) -> None:
                self.key, self.inner = key, handle.get_slice(key)

            def get_shape(self) -> Any:
                return self.inner.get_shape()

            def __getitem__(self, index: slice) -> torch.Tensor:
                out = self.inner[index]
                rows = (index.start, index.stop)
                recorder.reads.append((name, self.key, rows, out.numel()))
                return out  # type: ignore[no-any-return]

        class Handle:
            def __enter__(self) -> Handle:
                handle.__enter__()
                return self

            def __exit__(self, *exc: Any) -> None:
                handle.__exit__(*exc)

            def keys(self) -> Any:
                return handle.keys()

            def metadata(self) -> Any:
                return handle.metadata()

            def get_slice(self, key: str) -> Slice:
                return Slice(key)

            def get_tensor(self, key: str) -> torch.Tensor:
                out = handle.get_tensor(key)
                recorder.reads.append((name, key, None, out.numel()))
                return out  # type: ignore[no-any-return]

        return Handle()


def _check_reads(
    reads: list[tuple[str, str, tuple[int, int] | None, int]], model: nn.Module, tmp: Path
) -> None:
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


def _phase(rank: int, world: int, phase: int, stage: int, tmp: str) -> None:
    torch.manual_seed(0)
    per = GLOBAL_BATCH // world
    for name, make in OPTIMIZERS.items():
        config = ZeroConfig(stage=stage, min_shard_numel=100)  # type: ignore[arg-type]
        model, opt = prepare(tiny_llama(seed=phase), make, config)
        if phase > 0:
            previous = Path(tmp) / f"{name}-{phase - 1}"
            recorder = _Recorder(ckpt_module.safe_open)
            ckpt_module.safe_open = recorder  # type: ignore[assignment]
            try:
                load_checkpoint(previous, model, opt)
            finally:
                ckpt_module.safe_open = recorder.real
            _check_reads(recorder.reads, model, previous)
            expected = torch.load(Path(tmp) / f"{name}-{phase - 1}.sd", weights_only=True)
            loaded = full_state_dict(model)
            for key, value in expected.items():
                assert torch.equal(loaded[key], value), f"{name}: {key} changed in the reload"
        for batch in _batches()[phase * STEPS : (phase + 1) * STEPS]:
            ids = batch["input_ids"][rank * per : (rank + 1) * per]
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        save_checkpoint(Path(tmp) / f"{name}-{phase}", model, opt)
        final = full_state_dict(model)
        if rank == 0:
            torch.save(final, Path(tmp) / f"{name}-{phase}.sd")


@pytest.mark.distributed
def test_factored_state_reshards_1_2_4_2_1_and_reads_only_own_rows(tmp_path: Path) -> None:
    for phase, (world, stage) in enumerate(CHAIN):
        spawn(_phase, phase, stage, str(tmp_path), world_size=world, tmp_path=tmp_path)
    for name, make in OPTIMIZERS.items():
        model = tiny_llama(seed=0)
        init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        opt = make(list(model.parameters()))
        for batch in _batches():
            model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss.backward()
            opt.step()
            opt.zero_grad()
        got = torch.load(tmp_path / f"{name}-{len(CHAIN) - 1}.sd", weights_only=True)
        for key, final in model.state_dict().items():
            d_ref = (final - init[key]).double()
            err = (got[key].double() - init[key].double() - d_ref).norm() / d_ref.norm()
            assert err < 1e-4, f"{name}: {key}: update error {err:.3g} after 1->2->4->2->1"
