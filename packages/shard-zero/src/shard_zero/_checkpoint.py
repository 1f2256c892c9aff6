"""Sharded, atomic checkpoints keyed by parameter name and row range, loadable at any world size.

Layout of a checkpoint directory: one `rank{r:05d}.pt` per rank of the saving world, each a dict
`{"world_size", "rank", "param_groups", "params": {name: {"shape", "rows", "sharded",
"master", "state"}}}` where `master` is the fp32 shard (rows `rows` of the parameter) and
`state` the optimizer's state for it. A directory is written under `<path>.tmp` and renamed
into place by rank 0 once every rank has written, so a crash never leaves a half checkpoint at
`path`.

Resharding at a different world size: masters and state tensors shaped like the shard
(elementwise optimizers: AdamW's moments, SGD's momentum buffer) are concatenated by row range
and re-sliced. Other state tensors (factored statistics) are classified from the saved ranks: if
they are equal on every saved rank they are replicated (Adafactor's column statistics);
otherwise, if their dim 0 equals each saved rank's row count, they are row-sharded (its row
statistics) and re-sliced; anything else raises `ValueError`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shard_zero._api import engine_of
from shard_zero._layout import Entry
from shard_zero._optimizer import ZeroOptimizer

_FORMAT = 1


def _barrier(group: Any) -> None:
    dist.barrier(group=group)


def save_checkpoint(
    path: str | os.PathLike[str], model: nn.Module, optimizer: ZeroOptimizer
) -> None:
    """Write this rank's master shards and optimizer state to the directory `path` (collective).

    Args:
        path: the checkpoint directory (replaced atomically if it exists).
        model: the model returned by `prepare`.
        optimizer: the optimizer returned by `prepare`.
    """
    engine = engine_of(model)
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if engine.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(engine.group)
    inner = optimizer.optimizer
    params: dict[str, Any] = {}
    for e in engine.entries:
        state = {k: _to_cpu(v) for k, v in inner.state.get(e.master, {}).items()}
        params[e.name] = {
            "shape": e.shape,
            "rows": (e.start, e.end),
            "sharded": e.sharded,
            "master": _to_cpu(e.master),
            "state": state,
        }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    payload = {
        "format": _FORMAT,
        "world_size": engine.world,
        "rank": engine.rank,
        "param_groups": groups,
        "params": params,
    }
    torch.save(payload, tmp / f"rank{engine.rank:05d}.pt")
    _barrier(engine.group)
    if engine.rank == 0:
        old = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(engine.group)


def load_checkpoint(
    path: str | os.PathLike[str], model: nn.Module, optimizer: ZeroOptimizer
) -> None:
    """Load a `save_checkpoint` directory into a prepared model and optimizer (collective).

    The saving world size may differ from the current one (see the module docstring).

    Raises:
        FileNotFoundError: `path` holds no rank files.
        ValueError: the checkpoint's parameters do not match the model's, or a factored
            state tensor cannot be resharded to the new world size.
    """
    engine = engine_of(model)
    files = sorted(Path(path).glob("rank*.pt"))
    if not files:
        raise FileNotFoundError(f"no rank*.pt files in checkpoint directory {os.fspath(path)!r}")
    saved = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
    if len(saved) != saved[0]["world_size"]:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} has {len(saved)} rank files but was saved by "
            f"{saved[0]['world_size']} ranks"
        )
    same_world = len(saved) == engine.world
    inner = optimizer.optimizer
    names = set(saved[0]["params"])
    missing = sorted({e.name for e in engine.entries} ^ names)
    if missing:
        raise ValueError(f"checkpoint and model parameters differ: {missing[:8]}")
    for e in engine.entries:
        pieces = [s["params"][e.name] for s in saved]
        if tuple(pieces[0]["shape"]) != e.shape or pieces[0]["sharded"] != e.sharded:
            raise ValueError(
                f"parameter {e.name!r}: checkpoint shape {tuple(pieces[0]['shape'])} / sharded "
                f"{pieces[0]['sharded']} != model {e.shape} / {e.sharded} (same "
                "`min_shard_numel` required)"
            )
        mine = pieces[engine.rank] if same_world else None
        master = mine["master"] if mine is not None else _reslice(e, pieces, "master")
        e.master.data.copy_(master)
        state: dict[str, Any] = {}
        for key, value in pieces[0]["state"].items():
            if mine is not None:
                state[key] = mine["state"][key]
            elif not isinstance(value, torch.Tensor) or value.dim() == 0 or not e.sharded:
                state[key] = value
            else:
                state[key] = _reslice_state(e, pieces, key)
        if state:
            group = _group_of(inner, e.master)
            inner.state[e.master] = {k: _to_device(k, v, e.master, group) for k, v in state.items()}
        else:
            inner.state.pop(e.master, None)
    for group, saved_group in zip(inner.param_groups, saved[0]["param_groups"], strict=True):
        group.update(saved_group)
    engine.push_params()


def _to_cpu(value: Any) -> Any:
    """A CPU copy of a tensor (files hold CPU tensors whatever the model's device)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


def _group_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Any]:
    return next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), {})


def _to_device(key: str, value: Any, param: torch.Tensor, group: dict[str, Any]) -> Any:
    """Move a loaded state tensor to `param`'s device, as `Optimizer.load_state_dict` does.

    torch's optimizers keep `step` on the CPU unless `capturable` or `fused`; other tensors
    live with the parameter.
    """
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step" and not (group.get("capturable") or group.get("fused")):
        return value
    return value.to(param.device)


def _reslice(e: Entry, pieces: list[dict[str, Any]], key: str) -> torch.Tensor:
    if not e.sharded:
        return pieces[0][key]  # type: ignore[no-any-return]
    full = torch.cat([p[key] for p in pieces], dim=0)
    return full[e.start : e.end]


def _reslice_state(e: Entry, pieces: list[dict[str, Any]], key: str) -> torch.Tensor:
    values: list[torch.Tensor] = [p["state"][key] for p in pieces]
    rows = [p["rows"][1] - p["rows"][0] for p in pieces]
    if all(v.shape == p["master"].shape for v, p in zip(values, pieces, strict=True)):
        return torch.cat(values, dim=0)[e.start : e.end]
    if all(v.shape == values[0].shape and torch.equal(v, values[0]) for v in values):
        return values[0]
    if all(v.shape[0] == r for v, r in zip(values, rows, strict=True)):
        return torch.cat(values, dim=0)[e.start : e.end]
    raise ValueError(
        f"cannot reshard optimizer state {key!r} of {e.name!r} (shapes "
        f"{[tuple(v.shape) for v in values]}) to a different world size; load it at the saving "
        f"world size ({len(pieces)})"
    )
