"""DTensor parameters (FSDP2's `fully_shard`, `distribute_tensor`): local shards + row sharding.

A factored optimizer cannot run its math on DTensors: its statistics are not shaped like the
parameter, and row/column means must span the whole logical tensor. So `FactoredOptimizer` steps
a DTensor's local shard and drives `sharding.py`'s row-sharding protocol from its placements:
`Shard(0)` on one mesh dimension (FSDP2, HSDP's shard dimension) all-reduces the column and RMS
sums there, `Replicate` needs no reduction, anything else raises a `ValueError`. The state stays
plain local tensors, so `state_dict()` is per rank; for DCP use `distributed_state_dict`.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from optim_adafactor.sharding import RowShard, row_shard_of


def local_tensor(t: Tensor) -> Tensor:
    """The local shard of a DTensor (the same object every call), else `t` itself.

    `DTensor.to_local()` returns a fresh view at each call; the optimizer keys per-parameter
    caches by tensor, so it takes the DTensor's own local tensor. Writes into it update the
    parameter in place (FSDP2's sharded parameters are views into its padded shard storage).
    """
    if not isinstance(t, DTensor):
        return t
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, Tensor) else t.to_local()


def dtensor_row_shard(p: DTensor) -> RowShard | None:
    """The row shard of DTensor `p` implied by its placements (None: fully replicated)."""
    mesh, placements = p.device_mesh, tuple(p.placements)
    shard_dims = []
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Shard and placement.dim == 0:
            shard_dims.append(mesh_dim)
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"DTensor parameter with placements {placements}: factored optimizers support "
                "Shard(0) (FSDP2) on at most one mesh dimension and Replicate on the others"
            )
    if not shard_dims:
        return None
    if len(shard_dims) > 1:
        raise ValueError(
            f"DTensor parameter with placements {placements}: dim 0 is sharded over mesh "
            f"dimensions {shard_dims}; only one mesh dimension may shard it"
        )
    mesh_dim = shard_dims[0]
    size, coord = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    rows = p.shape[0]
    chunk = -(-rows // size)  # torch.chunk's chunk size
    offset = min(coord * chunk, rows)
    local_rows = local_tensor(p).shape[0]
    if offset + local_rows > rows:
        raise ValueError(
            f"DTensor parameter of shape {tuple(p.shape)}: local rows {local_rows} at offset "
            f"{offset} (mesh coordinate {coord} of {size}) exceed the global rows; only "
            "torch.chunk-style Shard(0) layouts are supported"
        )
    return RowShard(global_shape=tuple(p.shape), row_offset=offset, group=mesh.get_group(mesh_dim))


def localize(
    p: Tensor, grad: Tensor, registry: dict[Tensor, RowShard]
) -> tuple[Tensor, Tensor, RowShard | None]:
    """`(param, grad, row shard)` the step's math runs on.

    A DTensor parameter becomes its local shard, its gradient the gradient's local shard (the
    two must have the same placements) and its row shard comes from the placements; any other
    parameter is returned as is, with the row shard declared for it (`sharding.row_shard_of`).
    """
    if not isinstance(p, DTensor):
        if isinstance(grad, DTensor):
            raise TypeError("a plain-tensor parameter has a DTensor gradient")
        return p, grad, row_shard_of(p, registry)
    if not isinstance(grad, DTensor):
        raise TypeError(
            f"DTensor parameter of shape {tuple(p.shape)} has a plain-tensor gradient; "
            "expected a DTensor gradient with the parameter's placements"
        )
    p_place, g_place = tuple(p.placements), tuple(grad.placements)
    if p_place != g_place:
        raise ValueError(
            f"gradient placements {g_place} differ from the parameter's {p_place}; reduce the "
            "gradient to the parameter's placements first (FSDP2 does this in backward)"
        )
    shard = dtensor_row_shard(p)
    local, local_grad = local_tensor(p), local_tensor(grad)
    if shard is not None and local.dim() == 0:
        raise ValueError("a 0-dim DTensor parameter cannot be Shard(0)")
    return local, local_grad, shard


#: `distributed_state_dict` keys: per-parameter state, then the pickled groups and seed.
STATE, GROUPS = "state", "param_groups"


def distributed_state_dict(optimizer: Any, model: nn.Module) -> dict[str, Any]:
    """The state of a factored optimizer over `model`'s (DTensor) parameters, for DCP.

    `{"state": {parameter name: {key: value}}, "param_groups": bytes}`: every state tensor of a
    DTensor parameter becomes a DTensor over the parameter's mesh viewing it: a state shaped
    like the local shard gets the parameter's placements; a row statistic (`*_row`, blockwise
    quantization scales `*_scale`, and for 3+ dims `*_col`) gets them with dim 0 of global
    length; a 2-D parameter's column statistic (`*_col`, equal on every rank) is replicated.
    DCP then saves each logical tensor once and loads it at any number of ranks (then call
    `load_distributed_state_dict`). Plain `state_dict()` is per rank and must not go to DCP,
    which would keep one rank's copy of tensors that share a key. Other parameters'
    state stays as is, and the groups' hyper-parameters and the stochastic-rounding seed travel
    pickled (equal on every rank). Parameters get their zero state first if they have none, so
    that a checkpoint can be loaded before the first step. A collective of nothing: call it on
    every rank, like DCP's `save` / `load` it is passed to.
    """
    optimizer.init_state()
    names = {p: name for name, p in model.named_parameters(remove_duplicate=False)}
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for group in optimizer.param_groups:
        groups.append({k: v for k, v in group.items() if k != "params"})
        for p in group["params"]:
            if p not in names:
                raise ValueError(
                    f"an optimizer parameter of shape {tuple(p.shape)} is not a parameter of "
                    "`model`: pass the model whose parameters the optimizer steps"
                )
            state[names[p]] = {
                key: _as_dtensor(p, key, value, names[p])
                for key, value in optimizer.state[p].items()
            }
    extra = {"groups": groups, "seed": int(optimizer._sr_seed)}
    return {STATE: state, GROUPS: pickle.dumps(extra)}


def load_distributed_state_dict(optimizer: Any, model: nn.Module, loaded: dict[str, Any]) -> None:
    """Write what DCP loaded into a `distributed_state_dict(optimizer, model)` back into it.

    DCP loads the DTensors in place (into the optimizer's own local tensors); step counts,
    other values and the groups' hyper-parameters are set here, and the stochastic-rounding
    seed (with the step counts, all that the rounding noise depends on).
    """
    names = {p: name for name, p in model.named_parameters(remove_duplicate=False)}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            for key, saved in loaded[STATE][names[p]].items():
                value, old = local_tensor(saved), state.get(key)
                if isinstance(old, Tensor) and isinstance(value, Tensor):
                    if old.untyped_storage().data_ptr() != value.untyped_storage().data_ptr():
                        old.copy_(value)
                else:
                    state[key] = value
    extra = loaded[GROUPS]
    extra = pickle.loads(extra) if isinstance(extra, bytes) else extra
    for group, saved in zip(optimizer.param_groups, extra["groups"], strict=True):
        group.update(saved)
    optimizer._load_rng({"seed": extra["seed"]})


def _as_dtensor(p: Tensor, key: str, value: Any, name: str) -> Any:
    """`value` (a state entry of `p`) as a DTensor on `p`'s mesh, when `p` is a DTensor."""
    if not isinstance(p, DTensor) or not isinstance(value, Tensor) or value.dim() == 0:
        return value
    local = local_tensor(p)
    placements = tuple(p.placements)
    if value.shape == local.shape:
        shape = tuple(p.shape)
    elif key.endswith("_col") and local.dim() == 2 and value.shape == local.shape[-1:]:
        placements = tuple(Replicate() for _ in placements)  # all-reduced: equal everywhere
        shape = tuple(value.shape)
    elif key.endswith(("_row", "_col", "_scale")) and value.shape[:1] == local.shape[:1]:
        shape = (p.shape[0], *value.shape[1:])
    else:
        raise ValueError(
            f"optimizer state {key!r} of shape {tuple(value.shape)} for parameter {name!r} "
            f"(local shape {tuple(local.shape)}) has no known layout over the mesh"
        )
    stride = [1] * len(shape)  # contiguous
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return DTensor.from_local(
        value,
        p.device_mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=tuple(stride),
    )
