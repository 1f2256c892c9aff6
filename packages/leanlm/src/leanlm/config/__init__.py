"""Run configuration: frozen dataclasses, one per section, filled from Python or from TOML.

The bottom of leanlm: it imports no other part of it (and no torch), so a config loads and is
checked before any work starts. `configio` turns mappings into sections and back with errors
that name the key; `sections` and `extra_sections` hold the sections every run has;
`stage_sections` and `prune_section` the stages' own; `run` the `RunConfig` that holds them all
and the rules between them.
"""

from leanlm.config.configio import (
    ConfigError,
    from_dict,
    library_errors,
    non_negative,
    parse_override,
    positive,
    to_dict,
    with_overrides,
)
from leanlm.config.extra_sections import EvalConfig, LoggingConfig
from leanlm.config.prune_section import SEARCHED, PruneConfig
from leanlm.config.run import (
    FIRST_STAGES,
    STAGE_NAMES,
    STAGE_SECTIONS,
    RunConfig,
    dumps_toml,
    load_toml,
    override,
)
from leanlm.config.sections import (
    INIT_STAGE,
    DataConfig,
    ModelConfig,
    OptimizerName,
    TokenizerConfig,
    TrainConfig,
)
from leanlm.config.stage_sections import (
    DENSE_STAGE,
    ControlConfig,
    DistillConfig,
    PretrainConfig,
    SparsifyConfig,
)
from prune_distill.config import PRUNE_SIZES

__all__ = [
    "DENSE_STAGE",
    "FIRST_STAGES",
    "INIT_STAGE",
    "PRUNE_SIZES",
    "SEARCHED",
    "STAGE_NAMES",
    "STAGE_SECTIONS",
    "ConfigError",
    "ControlConfig",
    "DataConfig",
    "DistillConfig",
    "EvalConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerName",
    "PretrainConfig",
    "PruneConfig",
    "RunConfig",
    "SparsifyConfig",
    "TokenizerConfig",
    "TrainConfig",
    "dumps_toml",
    "from_dict",
    "library_errors",
    "load_toml",
    "non_negative",
    "override",
    "parse_override",
    "positive",
    "to_dict",
    "with_overrides",
]
