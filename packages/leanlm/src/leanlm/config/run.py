"""`RunConfig`: the whole run, its TOML form and the rules between its sections.

A TOML file mirrors the dataclasses: top-level keys of `RunConfig`, one table per section
(`leanlm.config.sections`, `extra_sections`), the run-level `[optim]` and `[parallel]` that load
resolves into the training stages (`shared_sections`), and one per stage (`stage_sections`,
`prune_section`; `STAGE_NAMES` in pipeline order). Unknown keys, wrong types and impossible
values raise `ConfigError` naming the dotted key before any work starts. This package imports no
other part of leanlm (and no torch), so checking a config is fast.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import tomli_w

from leanlm.config.configio import ConfigError, check_finite, from_dict, to_dict, with_overrides
from leanlm.config.extra_sections import EvalConfig, LoggingConfig
from leanlm.config.prune_section import SEARCHED, PruneConfig
from leanlm.config.sections import INIT_STAGE, DataConfig, ModelConfig, TokenizerConfig
from leanlm.config.shared_sections import (
    TRAINING_STAGES,
    named_from_shared,
    resolve_with_overrides,
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
    "FIRST_STAGES",
    "STAGE_NAMES",
    "STAGE_SECTIONS",
    "RunConfig",
    "dumps_toml",
    "load_toml",
    "override",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A whole run: data, tokenizer, model, and the stages to run in order."""

    name: str = "leanlm"
    """Shown in the report."""
    seed: int = 0
    """Seeds model initialisation and data order; in [0, 2**32): torch's CPU generator keeps
    the low 32 bits only, so a larger seed would repeat a smaller one's run."""
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    """Autocast precision for training and evaluation (parameters stay fp32). `fp16` needs a
    CUDA GPU: a run without one stops before any work, naming this key; and it trains only with
    `engine = "ddp"` (accelerate's loss scaler steps only the optimizers accelerate prepares)."""
    collective_timeout_s: float = 600.0
    """Seconds a process waits for the others in a collective (all-reduce, barrier, ...) before
    the run stops, naming the process that stopped answering. It is the `timeout` of the
    process group, so it also bounds how long the other processes wait while the main process
    prepares the corpus and tokenizer on first use: raise it for a corpus that takes longer."""
    cache_dir: str | None = None
    """Tokenizer / dataset cache; default `$LEANLM_CACHE_DIR` or `~/.cache/leanlm`."""
    stages: tuple[str, ...] = ("pretrain",)
    """Stages to run, in order; each reads the previous stage's output directory. A TOML config
    that leaves it unset (so runs `pretrain` only) but has another stage's section is refused."""
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
        check_finite(self)  # a section built in Python skipped `from_dict`'s check
        if not 0 <= self.seed < SEED_LIMIT:
            raise ConfigError(
                "seed",
                f"({self.seed}) must be in [0, 2**32) (0 to {SEED_LIMIT - 1}): torch's CPU "
                "generator keeps only the low 32 bits, so it would repeat the run of seed "
                f"{self.seed % SEED_LIMIT}",
            )
        if not 0 < self.collective_timeout_s < float("inf"):
            raise ConfigError(
                "collective_timeout_s",
                f"({self.collective_timeout_s}) must be a positive number of seconds, e.g. 600",
            )
        if not self.stages:
            raise ConfigError("stages", f"must list at least one stage of {list(STAGE_NAMES)}")
        for stage in self.stages:
            if stage not in STAGE_SECTIONS:
                raise ConfigError("stages", f"unknown stage {stage!r}; known: {list(STAGE_NAMES)}")
        if len(set(self.stages)) != len(self.stages):
            raise ConfigError("stages", f"lists a stage twice: {list(self.stages)}")
        if self.stages[0] not in FIRST_STAGES and not self.init_model:
            raise ConfigError(
                "stages",
                f"{self.stages[0]!r} needs a previous stage's model; start with "
                f"{' or '.join(repr(s) for s in FIRST_STAGES)} or set `init_model`",
            )
        for rule in _STAGE_RULES:  # the rules between sections, in pipeline order
            rule(self)
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


STAGE_SECTIONS: dict[str, type] = {
    "pretrain": PretrainConfig,
    "prune": PruneConfig,
    "distill": DistillConfig,
    "sparsify": SparsifyConfig,
    "control": ControlConfig,
}
"""The stages a run can list, in pipeline order, with their section's class (the type of the
`RunConfig` field of the same name; `leanlm.stages.STAGES` holds the stage of each)."""

STAGE_NAMES = tuple(STAGE_SECTIONS)
"""Stages a run can list, in the usual pipeline order."""

FIRST_STAGES = ("pretrain",)
"""The stages that build their own model, so can start a run without `init_model`."""

SEED_LIMIT = 2**32
"""`seed` must be below this (torch's CPU generator keeps a seed's low 32 bits)."""


def _check_stage_fields() -> None:
    """Every stage section is a `RunConfig` field of its type."""
    hints = typing.get_type_hints(RunConfig)
    for name, section in STAGE_SECTIONS.items():
        if hints.get(name) is not section:
            raise TypeError(f"`RunConfig.{name}` must be a field of type {section.__name__}")


_check_stage_fields()


def _pretrain_rules(run: RunConfig) -> None:
    """`pretrain` can only be the first stage; `[data] streaming` / `packing` feed it alone."""
    if "pretrain" in run.stages[1:]:
        raise ConfigError("stages", f"'pretrain' can only come first: {list(run.stages)}")
    # the other stages read the materialized training blocks (calibration, a teacher's
    # cache or correction) or train against a teacher that would not see the boundaries
    others = [s for s in run.stages if s != "pretrain"]
    for key in ("streaming", "packing"):
        if getattr(run.data, key) and others:
            raise ConfigError(
                f"data.{key}",
                f"(true) is supported for stage 'pretrain' only, but `stages` also has "
                f"{others}: run those in a run with {key} = false",
            )


def _prune_rules(run: RunConfig) -> None:
    """The target sizes do not exceed `[model]`'s, keep whole KV groups and fit a Llama.

    As `prune_distill.prune` plans them: a size left at 0 keeps the model's, and the KV heads
    of a model without grouped-query attention follow its query heads. Checked before any work
    whether or not the stage is listed; skipped with `init_model`, whose sizes are known only
    once it is loaded (`prune_distill.prune` checks them then).
    """
    if run.init_model:
        return
    target, model = run.prune, run.model
    for name in PRUNE_SIZES:
        value, current = getattr(target, name), getattr(model, name)
        if value > current:
            raise ConfigError(
                f"prune.{name}",
                f"({value}) must be <= `model.{name}` ({current}): pruning only shrinks",
            )
    group = model.num_attention_heads // model.num_key_value_heads
    heads = target.num_attention_heads or model.num_attention_heads
    kv = target.num_key_value_heads or (heads if group == 1 else model.num_key_value_heads)
    if heads % kv:
        raise ConfigError(
            "prune.num_attention_heads",
            f"({heads}) must be a multiple of the KV heads kept ({kv})",
        )
    if heads // kv > group:  # only with `num_key_value_heads` set: else kv keeps the groups
        raise ConfigError(
            "prune.num_key_value_heads",
            f"({kv}) leaves {heads // kv} query heads per KV group ({heads} / {kv}), more than "
            f"the model's {group}: query heads are kept within their group; keep at least "
            f"{-(-heads // group)} KV groups or fewer query heads",
        )
    hidden = target.hidden_size or model.hidden_size
    if not target.search and hidden % heads:  # a search skips such shapes itself
        if target.hidden_size:
            fit = max(hidden // heads, 1) * heads
            raise ConfigError(
                "prune.hidden_size",
                f"({hidden}) must be a multiple of the attention heads kept ({heads}), as the "
                f"pruned Llama's config requires: e.g. {fit}",
            )
        raise ConfigError(
            "prune.num_attention_heads",
            f"({heads}) must divide the hidden size kept (`model.hidden_size` = {hidden}), as "
            "the pruned Llama's config requires",
        )
    for name in SEARCHED:
        values, current = getattr(target, f"search_{name}"), getattr(model, name)
        if any(v > current for v in values):
            raise ConfigError(
                f"prune.search_{name}",
                f"({list(values)}) must be <= `model.{name}` ({current}): pruning only shrinks",
            )


def _distill_rules(run: RunConfig) -> None:
    """The teacher is a stage that runs before `distill` (or `init` with `init_model`).

    A `teacher_stage` that names no stage is refused even when `distill` is not listed.

    And `top_k` fits in `[tokenizer]`'s vocabulary (an `init_model`'s is checked at the start).
    """
    teacher = run.distill.teacher_stage
    if teacher not in STAGE_SECTIONS and teacher != INIT_STAGE:  # whether or not it is listed
        raise ConfigError(
            "distill.teacher_stage",
            f"({teacher!r}) names no stage: use one of {list(STAGE_NAMES)} that runs before "
            "'distill' (or 'init' for `init_model`)",
        )
    if "distill" not in run.stages:
        return
    if not run.init_model:
        run.distill.check_top_k(run.tokenizer.vocab_size, "`tokenizer.vocab_size`")
    before = list(run.stages[: run.stages.index("distill")])
    if run.init_model:
        before.append(INIT_STAGE)
    if teacher not in before:
        init = " (or 'init' for `init_model`)" if run.init_model else ""
        raise ConfigError(
            "distill.teacher_stage",
            f"{teacher!r} must be a stage that runs before 'distill'{init}; "
            f"stages: {list(run.stages)}",
        )


def _control_rules(run: RunConfig) -> None:
    """`control` comes last, after a compression stage, with a dense model to continue."""
    if "control" not in run.stages:
        return
    compared = [s for s in run.stages[:-1] if s != DENSE_STAGE]
    if run.stages[-1] != "control" or not compared:
        raise ConfigError(
            "stages",
            "'control' must be the last stage, after the compression stages it is "
            f"compared with: {list(run.stages)}",
        )
    if run.stages[0] != DENSE_STAGE and not run.init_model:
        raise ConfigError("stages", "'control' needs 'pretrain' first or `init_model`")


def _fp16_rules(run: RunConfig) -> None:
    """fp16 trains only under `ddp`: accelerate's loss scaler never sees a sharded engine's step."""
    if run.mixed_precision != "fp16":
        return
    for stage in run.stages:
        engine = getattr(run, stage).resolved_engine if stage in TRAINING_STAGES else "ddp"
        if engine != "ddp" and not (stage == "sparsify" and run.sparsify.steps == 0):
            raise ConfigError(
                f"{stage}.engine",
                f"({engine!r}) cannot train with `mixed_precision = 'fp16'`: its gradients would "
                "stay multiplied by accelerate's loss scale (the scaler unscales and steps only "
                "optimizers accelerate prepared); use `mixed_precision = 'bf16'` or "
                "`engine = 'ddp'`",
            )


_STAGE_RULES = (_pretrain_rules, _prune_rules, _distill_rules, _control_rules, _fp16_rules)
"""The rules between sections, each stage's own (`sparsify` has none), in pipeline order, then
the run-wide ones."""


def load_toml(path: str | Path, *, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a `RunConfig` from a TOML file, with `--set KEY=VALUE` `overrides` laid over it.

    Each override is read as the TOML line `KEY = VALUE` and checked with the file's keys
    (`leanlm.configio.with_overrides`). Run-level `[optim]` / `[parallel]` keys are copied into
    the training stages here (`leanlm.config.shared_sections`): the file's where a stage does
    not set the key, an override's over the file's values.

    Raises:
        ConfigError: for unknown keys, wrong types or impossible values (naming the key).
        FileNotFoundError: if `path` does not exist.
        ValueError: if `path` is a directory, cannot be read, or is not UTF-8 TOML text.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise ValueError(f"{path} is a directory, not a TOML config file") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text, so not a TOML config: {err}") from None
    except OSError as err:
        raise ValueError(f"{path} cannot be read: {err.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path} is not valid TOML: {err}") from err
    return _build(data, overrides)


def override(config: RunConfig, overrides: Sequence[str]) -> RunConfig:
    """`config` with `--set KEY=VALUE` `overrides`, checked as `load_toml` checks a file's keys.

    Raises:
        ConfigError: naming the dotted key of an unknown key, wrong type or impossible value.
    """
    if not overrides:
        return config
    return _build(to_dict(config), overrides)


def _build(data: dict[str, Any], overrides: Sequence[str]) -> RunConfig:
    """The `RunConfig` of a TOML mapping and overrides, `[optim]` / `[parallel]` resolved."""
    resolved, sources = resolve_with_overrides(data, overrides)
    try:
        config = from_dict(RunConfig, resolved)
    except ConfigError as err:
        raise named_from_shared(err, sources) from None
    _check_stages_set(with_overrides(data, overrides))
    return config


def _check_stages_set(data: Mapping[str, Any]) -> None:
    """A config without `stages` runs the default stages only: another stage's table is refused.

    `data` is the mapping as written (file and overrides, `[optim]` / `[parallel]` unresolved).
    A config that sets `stages` may keep sections of stages it does not list: a written-out
    config has every section, and `--set stages=[...]` narrows a pipeline.

    Raises:
        ConfigError: naming `stages` and the tables of the stages that would not run.
    """
    if "stages" in data:
        return
    default: tuple[str, ...] = RunConfig.stages
    idle = [s for s in STAGE_NAMES if s in data and s not in default]
    if idle:
        tables = ", ".join(f"[{s}]" for s in idle)
        listed = [s for s in STAGE_NAMES if s in default or s in idle]
        which = "that section" if len(idle) == 1 else "those sections"
        raise ConfigError(
            "stages",
            f"is not set, so only {list(default)} runs, but the config has {tables}, which "
            f"would be ignored: list the stages to run, e.g. `stages = {json.dumps(listed)}`, "
            f"or remove {which}",
        )


def dumps_toml(config: RunConfig) -> str:
    """The config as TOML text that `load_toml` reads back to an equal config."""
    return tomli_w.dumps(to_dict(config))
