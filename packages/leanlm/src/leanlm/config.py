"""Run configuration: frozen dataclasses, one per section, filled from Python or from TOML.

A TOML file mirrors the dataclasses: top-level keys of `RunConfig`, one table per section
(`[data]`, `[tokenizer]`, `[model]`, from `leanlm.sections`; `[eval]` and `[logging]` from
`leanlm.extra_sections`) and one per stage (`[pretrain]`,
...; each stage's section is defined in the stage's module and named by its `Stage.config`).
Unknown keys, wrong types and impossible values raise `ConfigError` (a `ValueError`) naming the
dotted key, before any work starts. The stages a run can list are the registered ones
(`leanlm.stages.STAGES`): importing a stage module registers it, and each has a `RunConfig`
field of its section's type (checked when this module is imported).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import tomli_w

from leanlm.configio import ConfigError, from_dict, to_dict, with_overrides
from leanlm.control import ControlConfig
from leanlm.distill import DistillConfig
from leanlm.extra_sections import EvalConfig, LoggingConfig
from leanlm.pretrain import PretrainConfig
from leanlm.prune import PruneConfig
from leanlm.sections import INIT_STAGE, DataConfig, ModelConfig, TokenizerConfig, TrainConfig
from leanlm.sparsify import SparsifyConfig
from leanlm.stages import STAGES
from prune_distill.config import PRUNE_SIZES

__all__ = [
    "INIT_STAGE",
    "PRUNE_SIZES",
    "STAGE_NAMES",
    "ConfigError",
    "ControlConfig",
    "DataConfig",
    "DistillConfig",
    "EvalConfig",
    "LoggingConfig",
    "ModelConfig",
    "PretrainConfig",
    "PruneConfig",
    "RunConfig",
    "SparsifyConfig",
    "TokenizerConfig",
    "TrainConfig",
    "dumps_toml",
    "from_dict",
    "load_toml",
    "override",
    "to_dict",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A whole run: data, tokenizer, model, and the stages to run in order."""

    name: str = "leanlm"
    """Shown in the report."""
    seed: int = 0
    """Seeds model initialisation and data order."""
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    """Autocast precision for training and evaluation (parameters stay fp32)."""
    collective_timeout_s: float = 600.0
    """Seconds a process waits for the others in a collective (all-reduce, barrier, ...) before
    the run stops, naming the process that stopped answering. It is the `timeout` of the
    process group, so it also bounds how long the other processes wait while the main process
    prepares the corpus and tokenizer on first use: raise it for a corpus that takes longer."""
    cache_dir: str | None = None
    """Tokenizer / dataset cache; default `$LEANLM_CACHE_DIR` or `~/.cache/leanlm`."""
    stages: tuple[str, ...] = ("pretrain",)
    """Stages to run, in order; each reads the previous stage's output directory."""
    init_model: str = ""
    """Start from this Hugging Face causal LM (a local folder or a hub id) instead of training
    one: its tokenizer replaces `[tokenizer]` and `[model]`, `pretrain` (if listed) continues
    training it, and the run may start with `prune`, `distill` or `sparsify`; `distill` may use
    it as teacher (`teacher_stage = "init"`). Empty: `pretrain` builds `[model]` from scratch."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """The corpus."""
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)
    """The tokenizer."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The model trained by `pretrain`."""
    pretrain: PretrainConfig = dataclasses.field(default_factory=PretrainConfig)
    """Settings of the `pretrain` stage."""
    prune: PruneConfig = dataclasses.field(default_factory=PruneConfig)
    """Settings of the `prune` stage."""
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    """Settings of the `distill` stage."""
    sparsify: SparsifyConfig = dataclasses.field(default_factory=SparsifyConfig)
    """Settings of the `sparsify` stage."""
    control: ControlConfig = dataclasses.field(default_factory=ControlConfig)
    """Settings of the `control` stage."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Downstream evaluation (lm-evaluation-harness tasks) of every stage's model."""
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    """Where training scalars go besides `metrics.jsonl` and TensorBoard (Weights & Biases)."""

    def __post_init__(self) -> None:
        if not 0 < self.collective_timeout_s < float("inf"):
            raise ConfigError(
                "collective_timeout_s",
                f"({self.collective_timeout_s}) must be a positive number of seconds, e.g. 600",
            )
        if not self.stages:
            raise ConfigError("stages", f"must list at least one stage of {list(STAGE_NAMES)}")
        for stage in self.stages:
            if stage not in STAGES:
                raise ConfigError("stages", f"unknown stage {stage!r}; known: {list(STAGE_NAMES)}")
        if len(set(self.stages)) != len(self.stages):
            raise ConfigError("stages", f"lists a stage twice: {list(self.stages)}")
        if STAGES[self.stages[0]].needs_input and not self.init_model:
            first = [name for name, stage in STAGES.items() if not stage.needs_input]
            raise ConfigError(
                "stages",
                f"{self.stages[0]!r} needs a previous stage's model; start with "
                f"{' or '.join(repr(s) for s in first)} or set `init_model`",
            )
        for name in STAGE_NAMES:  # the rules between sections, each stage's own
            STAGES[name].check_run(self)
        if self.model.max_position_embeddings < self.data.seq_len:
            raise ConfigError(
                "model.max_position_embeddings",
                f"({self.model.max_position_embeddings}) must be >= `data.seq_len` "
                f"({self.data.seq_len})",
            )

    def fingerprint(self, *sections: str) -> str:
        """A short stable hash of the named sections (all of them if none are given)."""
        data = to_dict(self)
        chosen = {k: data[k] for k in sections} if sections else data
        payload = json.dumps(chosen, sort_keys=True, default=str).encode()
        return hashlib.sha256(payload).hexdigest()[:16]


STAGE_NAMES = tuple(f.name for f in dataclasses.fields(RunConfig) if f.name in STAGES)
"""Stages a run can list (the registered ones), in the order of their `RunConfig` fields: the
usual pipeline order."""


def _check_stage_fields() -> None:
    """Every registered stage has a `RunConfig` field of its section's type, and vice versa."""
    hints = typing.get_type_hints(RunConfig)
    for name, stage in STAGES.items():
        if hints.get(name) is not stage.config:
            raise TypeError(
                f"stage {name!r} is registered but `RunConfig.{name}` is not a field of its "
                f"section type {stage.config.__name__}"
            )


_check_stage_fields()


def load_toml(path: str | Path, *, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a `RunConfig` from a TOML file, with `--set KEY=VALUE` `overrides` laid over it.

    Each override is read as the TOML line `KEY = VALUE` and checked with the file's keys
    (`leanlm.configio.with_overrides`).

    Raises:
        ConfigError: for unknown keys, wrong types or impossible values (naming the key).
        FileNotFoundError: if `path` does not exist.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path} is not valid TOML: {err}") from err
    return from_dict(RunConfig, with_overrides(data, overrides))


def override(config: RunConfig, overrides: Sequence[str]) -> RunConfig:
    """`config` with `--set KEY=VALUE` `overrides`, checked as `load_toml` checks a file's keys.

    Raises:
        ConfigError: naming the dotted key of an unknown key, wrong type or impossible value.
    """
    if not overrides:
        return config
    return from_dict(RunConfig, with_overrides(to_dict(config), overrides))


def dumps_toml(config: RunConfig) -> str:
    """The config as TOML text that `load_toml` reads back to an equal config."""
    return tomli_w.dumps(to_dict(config))
