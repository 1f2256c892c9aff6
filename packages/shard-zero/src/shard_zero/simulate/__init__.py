"""Simulate a multi-GPU training step of a full-size model on one CPU, without its memory.

`simulate(SimConfig(...))` runs shard-zero (each requested stage) and FSDP2 (with and without
resharding after forward) on a Hugging Face model built from a preset or a `config.json`, under
`FakeTensorMode` and torch's fake process group, and reports per-rank peak bytes by category,
a live-bytes timeline and the collectives of one step; `python -m shard_zero.simulate --help`.
Needs `transformers` (and `matplotlib` for the timeline plot): `pip install shard-zero[simulate]`.
"""

from shard_zero.simulate._presets import PRESET_PARAMS, PRESETS, model_config
from shard_zero.simulate._run import SimConfig, SimReport, SystemResult, simulate

__all__ = [
    "PRESETS",
    "PRESET_PARAMS",
    "SimConfig",
    "SimReport",
    "SystemResult",
    "model_config",
    "simulate",
]
