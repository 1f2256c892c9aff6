"""Checkpoint tests of sharded training: phases at changing world sizes, and what a load reads.

A chain of phases trains a tiny Llama for a few steps at one world size, saves a checkpoint
and the full state dict, and the next phase (another world size) loads the checkpoint and goes
on; at the end the weights must have moved as in one uninterrupted process. `spawn_chain`
runs `reshard_phase` at each world size; shard-zero's tests pass the `shard_zero` module itself (its
`ZeroConfig`, `prepare`, `load_checkpoint`, `save_checkpoint` and `full_state_dict`).
`recording_safe_open` records the tensors (and rows) a load reads from safetensors files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from leanlm_testing.distributed import spawn
from leanlm_testing.models import tiny_llama

#: One read of a tensor: (file name, key, rows read or None for the whole tensor, numel).
Read = tuple[str, str, tuple[int, int] | None, int]
MakeOptimizer = Callable[[list[torch.nn.Parameter]], Any]


class SafeOpenRecorder:
    """Stands in for `safetensors.safe_open`: records every tensor read (`reads`, as `Read`s)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.reads: list[Read] = []

    def __call__(self, path: Any, **kwargs: Any) -> Any:
        """Open `path` with the real `safe_open`; the handle records what is read through it."""
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


@contextmanager
def recording_safe_open(module: ModuleType) -> Iterator[list[Read]]:
    """Within the block `module.safe_open` records every read; yields the list of reads."""
    recorder = SafeOpenRecorder(module.safe_open)
    setattr(module, "safe_open", recorder)  # noqa: B010 (a module that has one; mypy can't tell)
    try:
        yield recorder.reads
    finally:
        setattr(module, "safe_open", recorder.real)  # noqa: B010


def train_rank_share(
    model: Any, opt: Any, rank: int, world: int, batches: Sequence[dict[str, torch.Tensor]]
) -> None:
    """One step per batch on this rank's equal share of its rows (causal-LM loss)."""
    for batch in batches:
        per = batch["input_ids"].shape[0] // world
        ids = batch["input_ids"][rank * per : (rank + 1) * per]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def reshard_phase(
    sz: ModuleType,
    rank: int,
    world: int,
    phase: int,
    stage: int,
    *,
    tmp: str,
    optimizers: Mapping[str, MakeOptimizer],
    batches: Sequence[dict[str, torch.Tensor]],
    load: Callable[[Path, Any, Any], None] | None = None,
) -> None:
    """Phase `phase` of a chain, on this rank: per optimizer, prepare, load, check, train, save.

    `sz.prepare` a tiny Llama (seed `phase`) at ZeRO `stage` (`min_shard_numel=100`). After
    phase 0, load the previous phase's checkpoint (`load(path, model, opt)`, by default
    `sz.load_checkpoint`): the full state dict must equal the one saved then. Train on this
    rank's share of `batches`, save the checkpoint `tmp/{name}-{phase}` and (rank 0) the full
    state dict `tmp/{name}-{phase}.sd`.
    """
    for name, make in optimizers.items():
        config = sz.ZeroConfig(stage=stage, min_shard_numel=100)
        model, opt = sz.prepare(tiny_llama(seed=phase), make, config)
        if phase > 0:
            previous = Path(tmp) / f"{name}-{phase - 1}"
            (load or sz.load_checkpoint)(previous, model, opt)
            expected = torch.load(Path(tmp) / f"{name}-{phase - 1}.sd", weights_only=True)
            loaded = sz.full_state_dict(model)
            for key, value in expected.items():
                assert torch.equal(loaded[key], value), f"{name}: {key} changed in the reload"
        train_rank_share(model, opt, rank, world, batches)
        sz.save_checkpoint(Path(tmp) / f"{name}-{phase}", model, opt)
        final = sz.full_state_dict(model)
        if rank == 0:
            torch.save(final, Path(tmp) / f"{name}-{phase}.sd")


def spawn_chain(
    phase_fn: Callable[..., None], chain: Sequence[tuple[int, int]], tmp_path: Path
) -> None:
    """`phase_fn(rank, world, phase, stage, str(tmp_path))` for each (world, stage) of `chain`.

    Each phase runs in `world` new processes (`spawn`), after the previous one has finished.
    """
    for phase, (world, stage) in enumerate(chain):
        spawn(phase_fn, phase, stage, str(tmp_path), world_size=world, tmp_path=tmp_path)


def assert_like_one_process(
    optimizers: Mapping[str, MakeOptimizer],
    batches: Sequence[dict[str, torch.Tensor]],
    saved: Callable[[str], Path],
    after: str,
) -> None:
    """Each optimizer's chain moved every tensor as one process stepping all `batches` does.

    `saved(name)` is the full state dict the chain's last phase saved; each tensor's update
    from the tiny Llama of seed 0 must be within a norm-relative 1e-4 of the single process's
    (the message names the chain: "after {after}").
    """
    for name, make in optimizers.items():
        model = tiny_llama(seed=0)
        init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        opt = make(list(model.parameters()))
        for batch in batches:
            model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss.backward()
            opt.step()
            opt.zero_grad()
        got = torch.load(saved(name), weights_only=True)
        for key, final in model.state_dict().items():
            d_ref = (final - init[key]).double()
            err = (got[key].double() - init[key].double() - d_ref).norm() / d_ref.norm()
            assert err < 1e-4, f"{name}: {key}: update error {err:.3g} after {after}"
