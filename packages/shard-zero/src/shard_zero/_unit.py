"""Stage 3: one wrapping unit, its parameters stored as views of one flat buffer.

`_units.Units` builds the units of a model and gathers and frees them; this module holds what
one unit is and which unit a parameter goes to.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shard_zero._comm import Gather
from shard_zero._layout import Bucket, Entry

_FREE, _GATHERING, _READY = 0, 1, 2


def _shared_across_units(model: nn.Module, wrapped: list[str]) -> set[torch.Tensor]:
    """Parameters held directly by modules of different units.

    A module's unit: its outermost wrapped ancestor (which takes the parameters of the wrapped
    modules inside it), or the root unit for a module outside every wrapped one.
    """
    units: dict[torch.Tensor, set[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        inside = [w for w in wrapped if name == w or name.startswith(w + ".")]
        unit = min(inside, key=len, default="")
        for p in module._parameters.values():
            if p is not None:
                units.setdefault(p, set()).add(unit)
    return {p for p, names in units.items() if len(names) > 1}


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (e.g. a recompute)."""
    return torch._C._current_graph_task_id() != -1


class Unit:
    """Parameters gathered and freed together, stored as views of one flat buffer.

    Attributes:
        layout: the all-gather layout (offsets of every entry in one rank's segment).
        grad_buckets: the buckets its gradients are reduced in, of at most `bucket_numel`
            elements (a large parameter in pieces of whole rows), in reverse registration
            order (the order backward produces them). For the root unit, the parameters
            registered after the last unit (e.g. the LM head, whose gradient comes first in
            backward) come first, then the rest (e.g. the embeddings, whose gradient is last).
    """

    def __init__(
        self,
        name: str,
        entries: list[Entry],
        dtype: torch.dtype,
        root: bool,
        *,
        ident: int,
        device: torch.device,
    ) -> None:
        self.name = name
        self.root = root
        self.ident = ident
        self.layout = Bucket(entries)
        self.grad_buckets: list[Bucket] = []
        numel = sum(e.param.numel() for e in entries)
        self.full = torch.empty(numel, dtype=dtype, device=device)
        self.nbytes = self.full.untyped_storage().nbytes()
        self.views: list[torch.Tensor] = []  # each entry's parameter inside `full`
        self.resting: list[torch.Tensor] = []  # each entry's stride-0 placeholder
        self.state = _READY
        self.gather: Gather | None = None
        self.grads_left = len(entries)  # gradients still to arrive in this backward

    @property
    def entries(self) -> list[Entry]:
        """The unit's (sharded, trainable) entries in layout order."""
        return self.layout.entries

    @property
    def ready(self) -> bool:
        """Whether the unit is gathered (its parameters hold their full values)."""
        return self.state == _READY

    def give_storage(self) -> None:
        """Give `full` its storage and point the parameters at their views (values unwritten)."""
        self.full.untyped_storage().resize_(self.nbytes)
        for e, view in zip(self.entries, self.views, strict=True):
            e.param.data = view

    def take_storage(self) -> None:
        """Release `full`'s storage and point the parameters at their placeholders."""
        self.full.untyped_storage().resize_(0)
        for e, rest in zip(self.entries, self.resting, strict=True):
            e.param.data = rest

    def free(self) -> None:
        """Release the gathered storage (the parameters become their placeholders)."""
        if self.state == _READY:
            self.take_storage()
            self.state = _FREE


def _unit_dtype(name: str, members: list[Entry]) -> torch.dtype:
    """The one dtype of a unit's parameters (fp32 for an empty unit)."""
    dtypes = {e.param.dtype for e in members}
    if len(dtypes) > 1:
        raise ValueError(
            f"stage 3 unit {name or '<root>'!r} mixes parameter dtypes "
            f"{sorted(map(str, dtypes))}; set `param_dtype` or use a `wrap_policy` "
            "with uniform dtypes"
        )
    return next(iter(dtypes)) if dtypes else torch.float32


_NOT_COPYABLE = (
    "of a model prepared by shard_zero at stage 3 is not supported: its parameters are "
    "placeholders outside forward and backward and its gathering hooks belong to this process "
    "group. For a copy (an EMA model, a snapshot) build the model again and load "
    "`shard_zero.full_state_dict(model)` into it; to save, use `shard_zero.save_checkpoint` or "
    "`full_state_dict`"
)


def check_no_create_graph() -> None:
    """Refuse a stage-3 backward that builds a graph (`create_graph=True`)."""
    if torch.is_grad_enabled():  # the engine enables grad for `create_graph=True` only
        raise RuntimeError(
            "shard-zero stage 3 does not support a backward with `create_graph=True` "
            "(a gradient penalty, double backward): the units are freed when this backward "
            "ends and the graph it creates reads them later; use stage 1 or 2"
        )


def _default_wrap_policy(model: nn.Module) -> Any:
    children = {
        id(child)
        for module in model.modules()
        if isinstance(module, nn.ModuleList)
        for child in module
    }
    return lambda name, module: id(module) in children
