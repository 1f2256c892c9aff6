"""Sharded, atomic checkpoints keyed by parameter name and row range, loadable at any world size.

Layout of a checkpoint directory written by N ranks: for each rank r,

* `rank{r:05d}.safetensors`: its fp32 master shard of every trainable parameter
  (`<name>::master`, rows `rows[name]` of the parameter) and the optimizer's tensor state for it
  (`<name>::state::<key>`); the header's metadata (`shard_zero`, JSON) holds the format, the
  rank, the world size and `rows` (each parameter's row range on that rank);
* `rank{r:05d}.meta.pt`: the optimizer's param groups and non-tensor state (e.g. integer steps),
  and its state-dict entries besides those (e.g. a stochastic-rounding seed).

Rank 0's file also holds the model's persistent buffers (`<name>::buffer`, e.g. BatchNorm's
running statistics), whole; every loading rank reads them from it.

A directory is written under `<path>.tmp` and renamed into place by rank 0 once every rank has
written, so a crash never leaves a half checkpoint at `path`.

Loading reads every rank file's header (shapes and row ranges, no tensor data) and rank 0's
`meta.pt`, then reads (`safe_open(...).get_slice(key)[a:b]`) only the rows of each tensor that
overlap this rank's rows: a rank never materialises another rank's shard. Whether an optimizer
state tensor is split by rows is decided from the saved shapes alone (`_row_sharded`), so ranks
never disagree: row-sharded ones are sliced, whole ones read from one saved rank (`rank %
saved_world`). A parameter saved replicated (below `min_shard_numel`) and loaded sharded, or the
reverse, is resliced the same way.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from shard_zero._api import ENGINE_ATTR, engine_of
from shard_zero._checkpoint_extra import (
    load_optimizer_extra,
    optimizer_extra,
    persistent_buffers,
)
from shard_zero._layout import Entry
from shard_zero._optimizer import ZeroOptimizer

_FORMAT = 2
_SEP = "::"
_META_KEY = "shard_zero"


def _tensors_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def _meta_file(rank: int) -> str:
    return f"rank{rank:05d}.meta.pt"


def _barrier(group: Any, distributed: bool = True) -> None:
    if distributed:  # a plain model's checkpoint is written by its one process alone
        dist.barrier(group=group)


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: ZeroOptimizer | torch.optim.Optimizer,
) -> None:
    """Write this rank's master shards and optimizer state to the directory `path` (collective).

    Rank 0 also writes the model's persistent buffers (its own values: a buffer that differs
    per rank, such as BatchNorm statistics without SyncBatchNorm, is saved as rank 0 has it).

    Args:
        path: the checkpoint directory (replaced atomically if it exists).
        model: the model returned by `prepare`, or a plain model: in one process without a
            process group, it is written as the one rank of a world-1 checkpoint (its
            parameters as the masters), which `load_checkpoint` reshards at any world size.
        optimizer: the optimizer returned by `prepare`, or the plain model's optimizer.

    Raises:
        TypeError: an optimizer state key is not a string.
    """
    engine = engine_of(model) if getattr(model, ENGINE_ATTR, None) is not None else None
    rank, world = (engine.rank, engine.world) if engine is not None else (0, 1)
    group = engine.group if engine is not None else None
    entries = engine.entries if engine is not None else _whole_entries(model)
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(group, engine is not None)
    inner = optimizer.optimizer if isinstance(optimizer, ZeroOptimizer) else optimizer
    tensors: dict[str, torch.Tensor] = {}
    rows: dict[str, tuple[int, int]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for e in entries:
        tensors[e.name + _SEP + "master"] = _to_cpu(e.master)
        rows[e.name] = (e.start, e.end) if e.sharded else (0, e.rows)
        scalars[e.name] = {}
        for key, value in inner.state.get(e.master, {}).items():
            if not isinstance(key, str):
                raise TypeError(f"optimizer state key {key!r} of {e.name!r} must be a str")
            if isinstance(value, torch.Tensor):
                tensors[e.name + _SEP + "state" + _SEP + key] = _to_cpu(value)
            else:
                scalars[e.name][key] = value
    buffers = persistent_buffers(model)
    if rank == 0:  # whole on every rank (as DDP, which broadcasts rank 0's): saved once
        for name, buffer in buffers.items():
            tensors[name + _SEP + "buffer"] = _to_cpu(buffer)
    header = {"format": _FORMAT, "rank": rank, "world_size": world, "rows": rows}
    save_file(tensors, tmp / _tensors_file(rank), metadata={_META_KEY: json.dumps(header)})
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    meta = {
        "format": _FORMAT,
        "world_size": world,
        "rank": rank,
        "param_groups": groups,
        "shapes": {e.name: e.shape for e in entries},
        "scalars": scalars,
        "buffers": sorted(buffers),
        "optimizer_extra": optimizer_extra(inner),
    }
    torch.save(meta, tmp / _meta_file(rank))
    _barrier(group, engine is not None)
    if rank == 0:
        old = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(group, engine is not None)


class _Files:
    """The saved ranks' safetensors files, opened lazily; headers are read without tensor data."""

    def __init__(self, root: Path, world: int, stack: ExitStack) -> None:
        self.paths = [root / _tensors_file(r) for r in range(world)]
        missing = [p.name for p in self.paths if not p.is_file()]
        if missing:
            raise ValueError(
                f"checkpoint {os.fspath(root)!r} was saved by {world} ranks but lacks {missing[:4]}"
            )
        self.stack = stack
        self.handles: dict[int, Any] = {}
        self.keys: dict[int, set[str]] = {}
        self.rows: dict[int, dict[str, tuple[int, int]]] = {}

    def handle(self, rank: int) -> Any:
        if rank not in self.handles:
            f = self.stack.enter_context(safe_open(self.paths[rank], framework="pt", device="cpu"))
            self.handles[rank] = f
            self.keys[rank] = set(f.keys())
            header = json.loads(f.metadata()[_META_KEY])
            self.rows[rank] = {k: (int(v[0]), int(v[1])) for k, v in header["rows"].items()}
        return self.handles[rank]

    def piece_rows(self, rank: int, name: str) -> tuple[int, int]:
        self.handle(rank)
        return self.rows[rank][name]

    def shape(self, rank: int, key: str) -> tuple[int, ...] | None:
        f = self.handle(rank)
        if key not in self.keys[rank]:
            return None
        return tuple(f.get_slice(key).get_shape())

    def read_rows(self, rank: int, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) (in the saved piece's own numbering) of tensor `key`."""
        return self.handle(rank).get_slice(key)[lo:hi]  # type: ignore[no-any-return]

    def read_whole(self, rank: int, key: str) -> torch.Tensor:
        return self.handle(rank).get_tensor(key)  # type: ignore[no-any-return]


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: ZeroOptimizer | torch.optim.Optimizer,
) -> None:
    """Load a `save_checkpoint` directory into a prepared model and optimizer (collective).

    The saving world size, stage and `min_shard_numel` may differ from the current ones; each
    rank reads only the rows it holds (see the module docstring). A plain model (not prepared)
    and its optimizer are loaded whole instead, in one process without a process group: every
    trainable parameter gets all its rows (its fp32 master, cast to its dtype) and the optimizer
    its state, as if the training had run unsharded. The model's persistent buffers get rank
    0's saved values on every rank (a checkpoint saved before buffers were written has none
    and leaves them as they are).

    Raises:
        FileNotFoundError: `path` holds no shard-zero checkpoint.
        ValueError: the checkpoint's parameters or persistent buffers do not match the
            model's, a rank file is missing, or an optimizer state tensor cannot be resharded.
    """
    prepared = getattr(model, ENGINE_ATTR, None) is not None
    engine = engine_of(model) if prepared else None
    entries = engine.entries if engine is not None else _whole_entries(model)
    root = Path(path)
    meta_path = root / _meta_file(0)
    if not meta_path.is_file():
        old = sorted(root.glob("rank*.pt"))
        hint = " (a format-1 checkpoint of an older shard-zero: re-save it)" if old else ""
        raise FileNotFoundError(
            f"no shard-zero checkpoint in {os.fspath(path)!r}: {meta_path.name} is missing{hint}"
        )
    meta = torch.load(meta_path, map_location="cpu", weights_only=True)
    if meta.get("format") != _FORMAT:
        raise ValueError(f"checkpoint format {meta.get('format')!r} != {_FORMAT}")
    shapes = {k: tuple(v) for k, v in meta["shapes"].items()}
    differ = sorted({e.name for e in entries} ^ set(shapes))
    if differ:
        raise ValueError(f"checkpoint and model parameters differ: {differ[:8]}")
    for e in entries:
        if shapes[e.name] != e.shape:
            raise ValueError(
                f"parameter {e.name!r}: checkpoint shape {shapes[e.name]} != model shape {e.shape}"
            )
    buffers = persistent_buffers(model)
    saved_buffers = meta.get("buffers")  # None: written before checkpoints held buffers
    if saved_buffers is not None and set(saved_buffers) != set(buffers):
        differ = sorted(set(saved_buffers) ^ set(buffers))
        raise ValueError(f"checkpoint and model buffers differ: {differ[:8]}")
    inner = optimizer.optimizer if isinstance(optimizer, ZeroOptimizer) else optimizer
    load_optimizer_extra(inner, meta.get("optimizer_extra"))  # before its state is filled
    with ExitStack() as stack:
        files = _Files(root, int(meta["world_size"]), stack)
        for e in entries:
            rank = engine.rank if engine is not None else 0
            _load_entry(e, files, rank, meta["scalars"][e.name], inner)
        for name in saved_buffers or []:
            _load_buffer(name, buffers[name], files)
    for group, saved_group in zip(inner.param_groups, meta["param_groups"], strict=True):
        group.update(saved_group)
    if engine is not None:
        engine.push_params()


def _load_buffer(name: str, buffer: torch.Tensor, files: _Files) -> None:
    key = name + _SEP + "buffer"
    shape = files.shape(0, key)
    if shape is None:
        raise ValueError(f"buffer {name!r} is missing from saved rank 0's file")
    if shape != tuple(buffer.shape):
        raise ValueError(
            f"buffer {name!r}: checkpoint shape {shape} != model shape {tuple(buffer.shape)}"
        )
    with torch.no_grad():
        buffer.copy_(files.read_whole(0, key))


def _whole_entries(model: nn.Module) -> list[Entry]:
    """The trainable parameters of a plain model as entries that hold every row.

    Each is its own master: `load_checkpoint` copies the saved fp32 masters into them.
    """
    entries = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            shape = tuple(p.shape)
            rows = shape[0] if shape else 1
            row_numel = p[0].numel() if p.dim() >= 1 and rows > 0 else 1
            entries.append(Entry(name, p, p, False, shape, 0, rows, 1, row_numel))
    return entries


def _load_entry(
    e: Entry, files: _Files, rank: int, scalars: dict[str, Any], inner: torch.optim.Optimizer
) -> None:
    world = len(files.paths)
    pieces = [(r, *files.piece_rows(r, e.name)) for r in range(world)]
    if all(p[1:] == (0, e.rows) for p in pieces):  # saved replicated: one piece holds it all
        pieces = [pieces[rank % world]]
    target = (e.start, e.end) if e.sharded else (0, e.rows)
    master = _read(
        e, files, pieces, target=target, rank=rank, key=e.name + _SEP + "master", label="master"
    )
    e.master.data.copy_(master.reshape(e.master.shape))
    prefix = e.name + _SEP + "state" + _SEP
    files.handle(pieces[0][0])
    keys = sorted(k[len(prefix) :] for k in files.keys[pieces[0][0]] if k.startswith(prefix))
    state: dict[str, Any] = dict(scalars)
    for key in keys:
        state[key] = _read(e, files, pieces, target=target, rank=rank, key=prefix + key, label=key)
    if state:
        group = _group_of(inner, e.master)
        inner.state[e.master] = {k: _to_device(k, v, e.master, group) for k, v in state.items()}
    else:
        inner.state.pop(e.master, None)


def _read(
    e: Entry,
    files: _Files,
    pieces: list[tuple[int, int, int]],
    *,
    target: tuple[int, int],
    rank: int,
    key: str,
    label: str,
) -> torch.Tensor:
    """This rank's value of tensor `key`: the overlapping rows of the pieces, or one whole copy."""
    shapes = [files.shape(r, key) for r, _, _ in pieces]
    absent = [r for (r, _, _), s in zip(pieces, shapes, strict=True) if s is None]
    if absent:
        raise ValueError(f"{e.name!r}: {label!r} is missing from saved rank(s) {absent[:4]}")
    known = [s for s in shapes if s is not None]
    if not _row_sharded(e, known, [hi - lo for _, lo, hi in pieces], label):
        return files.read_whole(pieces[rank % len(pieces)][0], key)
    parts = []
    for r, lo, hi in pieces:
        a, b = max(lo, target[0]), min(hi, target[1])
        if a < b:
            parts.append(files.read_rows(r, key, a - lo, b - lo))
    if not parts:  # this rank holds no rows: an empty tensor of the right shape and dtype
        return files.read_rows(pieces[0][0], key, 0, 0)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _row_sharded(e: Entry, shapes: list[tuple[int, ...]], rows: list[int], key: str) -> bool:
    """Whether a saved tensor is split by rows like the parameter, from the saved shapes alone.

    * shaped like the saved shard (elementwise state: AdamW's moments, SGD's momentum): by rows;
    * 0-dim: whole (one copy, e.g. a tensor step);
    * dim 0 equal to each saved rank's row count, and not the same shape on every saved rank:
      row-sharded (Adafactor/CAME row statistics with uneven shards);
    * the same shape on every saved rank and dim 0 not the row count: whole (column statistics);
    * both possible (e.g. saved at world 1, or a column count equal to the rows per rank): the
      parameter has >= 3 dims -> row-sharded (factored statistics of a stack of matrices keep the
      leading dim); else the state key decides: containing `row` -> row-sharded, `col` -> whole
      (the names Adafactor, CAME, torch and Hugging Face use), ending in `scale` with the
      parameter's number of dims -> row-sharded (the per-row block scales of a quantized state,
      e.g. `exp_avg_scale` of 8-bit CAME and Adafactor: rows x blocks); otherwise `ValueError`.
    """
    rest = e.shape[1:]
    if not e.shape:
        return False
    if all(s == (r, *rest) for s, r in zip(shapes, rows, strict=True)):
        return True
    if any(len(s) == 0 for s in shapes):
        return False
    by_rows = all(s[0] == r and s[1:] == shapes[0][1:] for s, r in zip(shapes, rows, strict=True))
    same = all(s == shapes[0] for s in shapes)
    if by_rows != same:
        return by_rows
    lower = key.lower()
    if by_rows and len(e.shape) >= 3:
        return True
    if by_rows and "row" in lower and "col" not in lower:
        return True
    if by_rows and "col" in lower and "row" not in lower:
        return False
    if by_rows and lower.endswith("scale") and len(shapes[0]) == len(e.shape):
        return True
    raise ValueError(
        f"cannot tell whether optimizer state {key!r} of {e.name!r} (saved shapes "
        f"{shapes[:4]}, rows per saved rank {rows[:4]}) is split by rows or whole; name row "
        "statistics '*row*', column statistics '*col*' and per-row block scales '*scale'"
    )


def _to_cpu(value: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy (files hold CPU tensors whatever the model's device)."""
    return value.detach().to("cpu", copy=True).contiguous()


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
