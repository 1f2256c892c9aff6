"""`gathered(model)`: every parameter's full value in the model, outside forward and backward.

What FSDP1's `summon_full_params`, FSDP2's `unshard()` and DeepSpeed's `GatheredParameters` give:
at stage 3 the parameters are placeholders at rest (`_units`), so reading or changing one needs
its unit gathered. Inside the block every stage-3 unit is gathered (one all-gather per unit, the
whole model in the compute dtype on every rank); on leaving, `writeback=True` copies this rank's
rows of every trainable parameter into its fp32 master (and the host rows of
`offload_optimizer`), so changes survive the next step, and the units gathered for the block are
freed; without it a stage-3 change is dropped. Blocks nest, and a forward inside one frees no
unit; a backward inside one does (then `writeback` raises instead of writing placeholders). At
stages 1-2 the parameters are full already and gathering costs nothing; a change there reaches
the masters only where they share the parameters' memory (fp32 without offload), and
`writeback` copies it into the others (the next step would undo it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from shard_zero._api import engine_of
from shard_zero._units import in_backward


@contextmanager
def gathered(model: nn.Module, *, writeback: bool = False) -> Iterator[None]:
    """Give every parameter of a prepared `model` its full value inside the block (a collective).

    Call it on every rank, outside forward and backward, with the same `writeback`. Blocks
    nest; a forward inside one frees no unit; units gathered before it stay gathered after it.

    Args:
        model: a model returned by `prepare`.
        writeback: copy the parameters' values into the fp32 masters on leaving the block (make
            the same change on every rank: each rank keeps its own rows). Needs fp32 compute
            parameters: from bf16 ones the masters would be rounded (`ValueError`); change
            bf16-computed models with `model.load_state_dict` and full-precision values.

    Raises:
        ValueError: `writeback=True` with a `param_dtype` other than fp32.
        RuntimeError: called inside forward or backward; or `writeback=True` after a backward
            inside the block freed a unit (nothing is written back).
    """
    engine = engine_of(model)
    if not isinstance(writeback, bool):
        raise ValueError(f"`writeback` must be True or False, got {writeback!r}")
    if writeback and any(e.param.dtype != torch.float32 for e in engine.entries):
        dtypes = sorted({str(e.param.dtype) for e in engine.entries})
        raise ValueError(
            f"gathered(writeback=True) needs fp32 compute parameters, the model's are {dtypes} "
            "(`param_dtype`): writing them back would round the fp32 masters; load changed "
            "values with `model.load_state_dict(...)` (full precision) instead"
        )
    units = engine.stage3.units if engine.stage == 3 else []
    if in_backward() or (units and engine.stage3.in_forward):
        raise RuntimeError(
            "shard_zero.gathered: called inside the model's forward or backward, whose units "
            "it would free; use it between steps, outside forward and backward"
        )
    # units gathered already (an outer block; the root unit after a forward, whose backward
    # may follow) stay gathered on leaving; inside the block no forward frees a unit (`pinned`)
    kept = [u for u in units if u.ready]
    for unit in units:  # every rank launches the units' all-gathers in the same order
        engine.stage3.gather_start(unit)
    for unit in units:
        engine.stage3.gather_wait(unit)
    if units:
        engine.stage3.pinned += 1
    done = False
    try:
        yield
        done = True
    finally:
        try:
            if units:
                engine.stage3.pinned -= 1
            if writeback and done:
                if not all(u.ready for u in units):
                    raise RuntimeError(
                        "shard_zero.gathered(writeback=True): a backward inside the block freed "
                        "a unit, whose parameters are placeholders now; nothing written back"
                    )
                with torch.no_grad():
                    for e in engine.entries:
                        engine.model_hooks.set_master(e, e.param.detach())
        finally:
            for unit in units:
                if unit not in kept:
                    unit.free()
