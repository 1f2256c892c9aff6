"""DTensor parameters (FSDP2's `fully_shard`, `distribute_tensor`): local shards + row sharding.

A factored optimizer cannot run its math on DTensors directly: the statistics it keeps are not
shaped like the parameter, and the row/column means must span the whole logical tensor. So
`FactoredOptimizer` steps the *local* shard of a DTensor parameter and drives the row-sharding
protocol of `sharding.py` from the DTensor's placements:

- `Shard(0)` on one mesh dimension (FSDP2, HSDP's shard dimension): the local tensor holds rows
  `[offset, offset + local_rows)` of the global tensor, chunked like `torch.chunk` (chunks of
  `ceil(rows / mesh size)` rows; trailing ranks may hold fewer rows, or none). Row statistics stay
  local; column sums, row-statistic sums and the RMS sums are all-reduced over that mesh
  dimension's process group, so the step equals the single-process step.
- `Replicate` (any mesh dimension, e.g. HSDP's replicate dimension): every replica holds the same
  values and gradients, so it needs no reduction.
- Anything else (`Shard(d)` with d > 0, `Partial`, strided shards of FSDP + tensor parallelism,
  dim 0 sharded over two mesh dimensions) raises a `ValueError` naming the placements.

The optimizer state of a DTensor parameter is kept as plain local tensors (the shard's rows of the
row statistics, the full column statistics, a local-shaped `exp_avg`). `state_dict()` therefore
returns each rank's own shard of the state; save and load it per rank (same mesh, same
placements). It is not a DTensor state dict, so `torch.distributed.checkpoint` would de-duplicate
the per-rank tensors that share a key: do not pass it to DCP.
"""

from __future__ import annotations

from torch import Tensor
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
