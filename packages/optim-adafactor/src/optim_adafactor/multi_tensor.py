"""Public building blocks of multi-tensor fused steps of factored optimizers.

Adafactor's multi-tensor step is built from these, and optim-came's fused CAME uses them and
nothing else of this package's kernels: the work split and its tables (`tables_for`, `Tables`,
`Group`, `Work`), the launchers of the factored statistics (`launch_stats`, `launch_cols`,
`launch_scalars`, for a table layout of `naddr` addresses per matrix: parameter, momentum, row
EMA, column EMA, then the caller's own), the batched step of small unfactored tensors
(`fusable`, `vec_tables`), the launch plan (`plan_launches`, `planned`) and, with Triton, the
`@triton.jit` helpers the kernels share. A caller's kernels read a matrix's `geo` row (`GEO`).
"""

from __future__ import annotations

from optim_adafactor._kernels import HAS_TRITON
from optim_adafactor._multi_kernels import (
    STAGES,
    eligible_matrix,
    launch_cols,
    launch_config,
    launch_scalars,
    launch_stats,
    stages,
    tables_for,
)
from optim_adafactor._multi_tables import (
    _INTERPRET as INTERPRET,
)
from optim_adafactor._multi_tables import (
    GEO,
    ITEM_ELEMENTS,
    Group,
    Launch,
    Tables,
    Work,
    aligned,
    plan_launches,
    planned,
    planning,
    recording,
    size,
)
from optim_adafactor._multi_vec_kernels import BLOCK as VEC_BLOCK
from optim_adafactor._multi_vec_kernels import NUM_WARPS as VEC_NUM_WARPS
from optim_adafactor._multi_vec_kernels import VecTables, fusable, vec_tables

__all__ = [
    "GEO",
    "HAS_TRITON",
    "INTERPRET",
    "ITEM_ELEMENTS",
    "STAGES",
    "VEC_BLOCK",
    "VEC_NUM_WARPS",
    "Group",
    "Launch",
    "Tables",
    "VecTables",
    "Work",
    "aligned",
    "eligible_matrix",
    "fusable",
    "launch_cols",
    "launch_config",
    "launch_scalars",
    "launch_stats",
    "plan_launches",
    "planned",
    "planning",
    "recording",
    "size",
    "stages",
    "tables_for",
    "vec_tables",
]

if HAS_TRITON:
    from optim_adafactor._jit_helpers import (
        row_item,
        span,
        sr_counters,
        sr_vector_counters,
        store_update,
        tensor_seed,
        tile,
        vector_ema,
        vector_load,
    )
    from optim_adafactor._multi_kernels import cols_launch_config
    from optim_adafactor._multi_stats_kernels import _mt_stats_kernel as stats_kernel
    from optim_adafactor._multi_stats_kernels import apply_scalars

    __all__ += ["apply_scalars", "cols_launch_config", "stats_kernel", "store_update"]
    __all__ += ["row_item", "span", "tensor_seed", "tile", "vector_ema", "vector_load"]
    __all__ += ["sr_counters", "sr_vector_counters"]
