"""Run-level `[optim]` and `[parallel]`: training settings said once for every training stage.

Resolved at load, on the TOML mapping: each key of these tables is copied into every training
stage's table (`pretrain`, `distill`, `sparsify`, `control`) that does not set it itself, and the
tables are dropped. So the stages, the run folder's `config.toml` and the stage hashes see only
per-stage values: a config written either way resolves to the same `RunConfig`.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from leanlm.config.configio import ConfigError, convert_value, merge_tables, with_overrides
from leanlm.config.sections import TrainConfig

SHARED_KEYS: dict[str, tuple[str, ...]] = {
    "optim": (
        "optimizer",
        "lr",
        "min_lr_ratio",
        "weight_decay",
        "betas",
        "grad_clip",
        "state_dtype",
    ),
    "parallel": (
        "engine",
        "zero_stage",
        "zero_accum_dtype",
        "zero_offload_accum",
        "zero_offload_optimizer",
        "activation_checkpointing",
        "compile",
    ),
}
"""The run-level tables and the `TrainConfig` keys each may set."""

TRAINING_STAGES = ("pretrain", "distill", "sparsify", "control")
"""The stage tables that the run-level tables fill (the `TrainConfig` sections)."""


def _checked(section: str, table: Any) -> dict[str, Any]:
    """The run-level `table`, each key known and its value of the `TrainConfig` field's type."""
    if not isinstance(table, Mapping):
        raise ConfigError(section, f"must be a table, got {type(table).__name__} {table!r}")
    valid = SHARED_KEYS[section]
    hints = typing.get_type_hints(TrainConfig)
    for key in table:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            raise ConfigError(f"{section}.{key}", f"unknown key{hint}; valid keys: {list(valid)}")
    return {k: convert_value(v, hints[k], f"{section}.{k}") for k, v in table.items()}


def resolve_shared(data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """`data` with `[optim]` / `[parallel]` copied into the training stages' tables and dropped.

    A key a stage's table sets itself wins. Also returns `{"stage.key": "section.key"}` for each
    value filled in, so an error found in a stage can name the run-level key it came from.

    Raises:
        ConfigError: naming `optim.KEY` / `parallel.KEY` for an unknown key or a bad value.
    """
    resolved = {k: v for k, v in data.items() if k not in SHARED_KEYS}
    sources: dict[str, str] = {}
    for section in SHARED_KEYS:
        if section not in data:
            continue
        for key, value in _checked(section, data[section]).items():
            for stage in TRAINING_STAGES:
                table = resolved.get(stage, {})
                if not isinstance(table, Mapping):
                    continue  # `from_dict` names the stage key
                if key not in table:
                    resolved[stage] = {**table, key: value}
                    sources[f"{stage}.{key}"] = f"{section}.{key}"
    return resolved, sources


def resolve_with_overrides(
    data: Mapping[str, Any], overrides: Sequence[str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """`data` resolved, with `--set KEY=VALUE` `overrides` resolved alike and laid over it.

    So `--set optim.lr=1e-3` sets `lr` in every training stage, over the file's values (a
    command line beats the file), and a `--set pretrain.lr=...` among the overrides wins.
    """
    resolved, sources = resolve_shared(data)
    update, from_update = resolve_shared(with_overrides({}, overrides))
    for key in list(sources):
        stage, name = key.split(".")
        if name in update.get(stage, {}):
            del sources[key]
    return merge_tables(resolved, update), {**sources, **from_update}


def named_from_shared(err: ConfigError, sources: Mapping[str, str]) -> ConfigError:
    """`err`, saying which of the stage's values came from `[optim]` / `[parallel]`.

    An error on such a value names the run-level key; one on the stage's own key lists them.
    """
    stage = err.key.split(".")[0]
    shared = sources.get(err.key)
    if shared is not None:
        return ConfigError(shared, f"{err.message} (in [{stage}], which takes it from there)")
    taken = [v for k, v in sources.items() if k.startswith(f"{stage}.")]
    if not taken:
        return err
    listed = ", ".join(f"`{k}`" for k in taken)
    return ConfigError(err.key, f"{err.message} ([{stage}] takes {listed} from the run level)")
