"""Deferred initialisation: `prepare` a model built on the `meta` device.

The model's meta parameters are first replaced by *placeholders* on the target device: at stage 3
a stride-0 view of one element (a full-shaped tensor that holds no memory), at stages 1-2 an
uninitialised full tensor (those stages keep full compute parameters anyway). The engine then
builds its shards as usual (from the placeholders: no real values yet), and the values are filled
in afterwards, one parameter at a time:

* from an init function: `init(module)` is called on every module in `nn.Module.apply` order
  (children first), with that module's own parameters swapped for full temporary tensors and its
  meta buffers materialised. Once a parameter's last owning module has been initialised (tied
  parameters are kept until then), its rows are copied into this rank's master shard and the
  temporary is dropped. Its parent's init may rewrite it whole (`_swap_children`). Under the
  same seed this reproduces `model.apply(init)` on a model built normally, value for value.
* from a Hugging Face checkpoint folder (`model.safetensors`, or the shards listed in
  `model.safetensors.index.json`): each rank reads only its rows of every sharded parameter
  (`safe_open(...).get_slice(name)[start:end]`) and whole tensors only for replicated (small) and
  frozen parameters and buffers. Buffers the checkpoint does not hold (e.g. rotary `inv_freq`) are
  initialised by `init`, or by the model's own `_init_weights` (Hugging Face models).

So at stage 3 a rank holds its fp32 shards plus, transiently, one module's full parameters (and
tied parameters until their last owner), never the whole fp32 model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from shard_zero._engine import ZeroEngine

Init = Callable[[nn.Module], Any]


def is_deferred(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` is on the meta device."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def make_placeholders(
    model: nn.Module, *, device: torch.device, stage: int, param_dtype: torch.dtype | None
) -> dict[int, torch.dtype]:
    """Replace every meta parameter by a placeholder on `device` (tied ones stay tied).

    Returns:
        `id(placeholder) -> dtype` of the original parameter (the dtype values are built in).
    """
    new: dict[int, nn.Parameter] = {}
    dtypes: dict[int, torch.dtype] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                dtype = (
                    param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype
                )
                if stage == 3:
                    data = torch.zeros((), dtype=dtype, device=device).expand(p.shape)
                else:
                    data = torch.empty(p.shape, dtype=dtype, device=device)
                holder = nn.Parameter(data, requires_grad=p.requires_grad)
                new[id(p)] = holder
                dtypes[id(holder)] = p.dtype
            module._parameters[name] = new[id(p)]
    return dtypes


def fill(
    model: nn.Module,
    engine: ZeroEngine,
    dtypes: dict[int, torch.dtype],
    *,
    init: Init | None,
    checkpoint: str | os.PathLike[str] | None,
) -> None:
    """Give the placeholders their values (see the module docstring), then sync the model."""
    for e in engine.replicated:  # a replicated parameter keeps a full copy: give it memory
        if id(e.param) in dtypes and e.param.numel() > 1 and 0 in e.param.stride():
            e.param.data = torch.empty(e.shape, dtype=e.param.dtype, device=engine.device)
    filler = _Filler(engine, dtypes)
    if checkpoint is not None:
        _from_checkpoint(model, filler, Path(checkpoint), init)
    else:
        assert init is not None
        _from_init(model, filler, init)
    unfilled = len(dtypes) - len(filler.done)
    if unfilled:
        raise ValueError(f"{unfilled} parameters on the meta device got no value")
    still = [n for n, b in model.named_buffers() if b.is_meta]
    if still:
        raise ValueError(
            f"buffers {still[:4]} are still on the meta device after deferred initialisation: "
            "`init` must initialise them (or the checkpoint hold them)"
        )
    engine.push_params()


class _Filler:
    """Copies a parameter's full value into this rank's master rows (or the frozen parameter)."""

    def __init__(self, engine: ZeroEngine, dtypes: dict[int, torch.dtype]) -> None:
        self.engine = engine
        self.dtypes = dtypes
        self.entry = {id(e.param): e for e in engine.entries}
        self.done: set[int] = set()

    def rows(self, p: nn.Parameter) -> tuple[int, int] | None:
        """The rows of `p` this rank needs (None: all of it)."""
        e = self.entry.get(id(p))
        return (e.start, e.end) if e is not None and e.sharded else None

    def put(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """`value`: the rows `rows(p)` of the parameter's initial value (any dtype, any device)."""
        e = self.entry.get(id(p))
        with torch.no_grad():
            if e is None:  # frozen: the model keeps it whole, in its compute dtype
                p.data = value.to(device=self.engine.device, dtype=p.dtype).reshape(p.shape)
            else:
                e.master.copy_(value.reshape(e.master.shape))
        self.done.add(id(p))


def _visit(module: nn.Module) -> Iterator[nn.Module]:
    """Modules in `nn.Module.apply` order: children (recursively) first, then the module."""
    for child in module.children():
        yield from _visit(child)
    yield module


def _from_init(model: nn.Module, filler: _Filler, init: Init) -> None:
    order = list(_visit(model))
    visits: dict[int, int] = {}
    for module in order:
        for p in module._parameters.values():
            if p is not None and id(p) in filler.dtypes:
                visits[id(p)] = visits.get(id(p), 0) + 1
    temps: dict[int, nn.Parameter] = {}
    device = filler.engine.device
    prefix = {id(m): f"{n}." if n else "" for n, m in model.named_modules(remove_duplicate=False)}
    for module in order:
        swapped = []
        for name, p in list(module._parameters.items()):
            if p is None or id(p) not in filler.dtypes:
                continue
            if id(p) not in temps:
                full = _unwritten(p.shape, filler.dtypes[id(p)], device)
                temps[id(p)] = nn.Parameter(full, requires_grad=p.requires_grad)
            module._parameters[name] = temps[id(p)]
            swapped.append((name, p))
        made = []
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = _unwritten(b.shape, b.dtype, device)
                made.append(name)
        again = _swap_children(module, filler, temps, device)
        with torch.no_grad():
            init(module)
        for name in made:
            _check_written(f"buffer {prefix[id(module)]}{name}", module._buffers[name])
        for child, name, p, fresh in again:
            child._parameters[name] = p
            if fresh is not None:  # finished by the child's own init: rewritten by this one?
                _put_rewritten(f"{prefix[id(child)]}{name}", p, fresh.detach(), filler)
        for name, p in swapped:
            module._parameters[name] = p
            visits[id(p)] -= 1
            if visits[id(p)] == 0:  # its last owner is initialised: keep only our rows
                full = temps.pop(id(p)).detach()
                _check_written(f"parameter {prefix[id(module)]}{name}", full)
                rows = filler.rows(p)
                filler.put(p, full if rows is None else full[rows[0] : rows[1]])


def _swap_children(
    module: nn.Module, filler: _Filler, temps: dict[int, nn.Parameter], device: torch.device
) -> list[tuple[nn.Module, str, nn.Parameter, nn.Parameter | None]]:
    """Give `module`'s children's parameters full tensors for `module`'s own `init`.

    `model.apply(init)` lets a module's init rewrite its children's parameters after their own
    init (Hugging Face's GPT-2 scales `c_proj.weight` from `GPT2Attention`): a parameter still
    held whole (`temps`) is lent as it is, a finished one as a fresh `_unwritten` tensor.
    Returns `(child, name, placeholder, fresh tensor or None)` to restore and read back.
    """
    out = []
    lent: dict[int, nn.Parameter] = dict(temps)
    for child in module.children():
        for name, p in list(child._parameters.items()):
            if p is None or id(p) not in filler.dtypes:
                continue
            new = id(p) not in lent  # read back once, after the init (shared: first entry)
            if new:
                full = _unwritten(p.shape, filler.dtypes[id(p)], device)
                lent[id(p)] = nn.Parameter(full, requires_grad=p.requires_grad)
            child._parameters[name] = lent[id(p)]
            out.append((child, name, p, lent[id(p)] if new else None))
    return out


def _put_rewritten(what: str, p: nn.Parameter, value: torch.Tensor, filler: _Filler) -> None:
    """Keep `value` if a parent's init rewrote the whole finished parameter `p`; else nothing."""
    left = (
        torch.isnan(value) if value.is_floating_point() else value == torch.iinfo(value.dtype).min
    )
    if bool(left.all()):
        return
    if bool(left.any()):
        raise ValueError(
            f"deferred initialisation: a parent's `init` rewrote {int((~left).sum())} of "
            f"{value.numel()} elements of parameter {what}, initialised before by its own "
            "module: rewriting part of a child's parameter is not supported (all of it is)"
        )
    rows = filler.rows(p)
    filler.put(p, value if rows is None else value[rows[0] : rows[1]])


def _checkpoint_files(folder: Path) -> dict[str, Path]:
    """`tensor name -> file` of a Hugging Face safetensors checkpoint folder."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(
            f"`checkpoint` ({os.fspath(folder)!r}) holds neither model.safetensors nor "
            "model.safetensors.index.json"
        )
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _from_checkpoint(model: nn.Module, filler: _Filler, folder: Path, init: Init | None) -> None:
    where = _checkpoint_files(folder)
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in filler.dtypes:
            names.setdefault(id(p), []).append(name)
            params[id(p)] = p
    missing = [aliases[0] for aliases in names.values() if not any(n in where for n in aliases)]
    if missing:
        raise ValueError(f"`checkpoint` {os.fspath(folder)!r} lacks parameters {missing[:8]}")
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def handle(path: Path) -> Any:
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            return handles[path]

        for pid, aliases in names.items():
            p = params[pid]
            key = next(n for n in aliases if n in where)
            piece = handle(where[key]).get_slice(key)
            shape = tuple(piece.get_shape())
            if shape != tuple(p.shape):
                raise ValueError(
                    f"`checkpoint` tensor {key!r} has shape {shape}, the model's is "
                    f"{tuple(p.shape)}"
                )
            rows = filler.rows(p)
            value = (
                piece[rows[0] : rows[1]] if rows is not None else handle(where[key]).get_tensor(key)
            )
            filler.put(p, value)
        pending: dict[nn.Module, list[str]] = {}
        for qualified, _ in model.named_buffers(remove_duplicate=False):
            owner_name, _, attr = qualified.rpartition(".")
            owner = model.get_submodule(owner_name)
            buffer = owner._buffers[attr]
            if buffer is None or not buffer.is_meta:
                continue
            if qualified in where:
                owner._buffers[attr] = (
                    handle(where[qualified])
                    .get_tensor(qualified)
                    .to(device=filler.engine.device, dtype=buffer.dtype)
                )
            else:
                pending.setdefault(owner, []).append(attr)
    init_fn = init if init is not None else getattr(model, "_init_weights", None)
    for owner, attrs in pending.items():
        if init_fn is None:
            raise ValueError(
                f"buffers {attrs} of {type(owner).__name__} are not in `checkpoint`: pass `init` "
                "to initialise them"
            )
        for attr in attrs:
            meta = owner._buffers[attr]
            assert meta is not None
            owner._buffers[attr] = _unwritten(meta.shape, meta.dtype, filler.engine.device)
        saved = dict(owner._parameters)
        for name, kept in saved.items():  # `init` must not write into the loaded parameters
            if kept is not None:
                owner._parameters[name] = nn.Parameter(
                    torch.empty_like(kept, device="meta"), requires_grad=kept.requires_grad
                )
        with torch.no_grad():
            init_fn(owner)
        owner._parameters.update(saved)
        for attr in attrs:
            _check_written(f"buffer {attr!r} of {type(owner).__name__}", owner._buffers[attr])


def _unwritten(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor for `init` to write, filled so that `_check_written` finds what it left alone.

    NaN (floating, complex) or the dtype's minimum (integers); bool is not checked.
    """
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)


def _check_written(what: str, value: torch.Tensor | None) -> None:
    """Raise if `init` left any element of `value` (from `_unwritten`) as it was."""
    if value is None or value.dtype == torch.bool or value.numel() == 0:
        return
    if value.dtype.is_floating_point or value.dtype.is_complex:
        left = torch.isnan(value)
    else:
        left = value == torch.iinfo(value.dtype).min
    if bool(left.any()):
        raise ValueError(
            f"deferred initialisation: `init` left {int(left.sum())} of {value.numel()} "
            f"elements of {what} {tuple(value.shape)} unset (or set them to NaN): on the meta "
            "device its constructor set no value, so `init` must set every parameter and "
            "buffer (e.g. `init=model._init_weights` for a Hugging Face model, or call "
            "`module.reset_parameters()` in it)"
        )
