"""leanlm: train and compress LLMs with less memory, end to end.

The pipeline runs the stages of a `RunConfig` (`pretrain` → `prune` → `distill` → `sparsify`)
and writes a report: `leanlm demo`, `leanlm run CONFIG.toml`, or `run_pipeline(config, out_dir)`
from Python.
"""

from importlib.metadata import version

from leanlm.config import (
    ConfigError,
    DataConfig,
    DistillConfig,
    ModelConfig,
    PretrainConfig,
    PruneConfig,
    RunConfig,
    SparsifyConfig,
    TokenizerConfig,
    load_toml,
)
from leanlm.presets import PRESETS

__version__ = version("leanlm")

__all__ = [
    "PRESETS",
    "ConfigError",
    "DataConfig",
    "DistillConfig",
    "ModelConfig",
    "PretrainConfig",
    "PruneConfig",
    "RunConfig",
    "SparsifyConfig",
    "TokenizerConfig",
    "__version__",
    "load_toml",
]
