"""The model and data a run starts from, checked before any work: present, or reachable.

`check_init_model`: an `init_model` folder must hold a causal LM transformers knows, its tokenizer
and every weight shard; a hub id must be reachable or cached. `check_hub_dataset`: with no
network, a hub dataset is read from the cache only. Both switch huggingface_hub / datasets to
their caches (`HF_HUB_OFFLINE`, `HF_DATASETS_OFFLINE`) when the hub cannot be reached, for this
process and the workers it starts. Part of `leanlm.run.rundir.preflight`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from leanlm.config import ConfigError, RunConfig

_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_TRUE = {"1", "true", "yes", "on"}


def hub_reachable(timeout: float = 3.0) -> bool:
    """False when `HF_HUB_OFFLINE` is set or the hub's host does not answer within `timeout` s."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE:
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False


def _go_offline() -> None:
    """Make huggingface_hub / datasets use their caches only, here and in the workers.

    Both libraries read the variables at import; when already imported, their constants are set.
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    for module, names in (
        ("huggingface_hub.constants", ("HF_HUB_OFFLINE",)),
        ("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")),
    ):
        if module in sys.modules:
            for name in names:
                setattr(sys.modules[module], name, True)


def check_init_model(name: str, *, weights: bool = True) -> None:
    """`init_model` must be a causal-LM folder with a tokenizer, or a reachable / cached hub id.

    A folder needs a `config.json` of a causal-LM architecture transformers knows and, with
    `weights`, its tokenizer and every weight shard (`model.safetensors`, or the shards a
    `model.safetensors.index.json` lists). `weights=False` checks the config only (`leanlm
    plan` reads nothing else).

    Raises:
        ConfigError: naming `init_model`, the path and what is missing.
    """
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError("init_model", f"{name!r} is not a model folder (no config.json)")
        try:
            config = json.loads((path / "config.json").read_text())
        except ValueError as err:
            raise ConfigError("init_model", f"{path / 'config.json'} is not JSON: {err}") from None
        arch = config.get("architectures") or []
        if not any(str(a).endswith("ForCausalLM") for a in arch):
            raise ConfigError(
                "init_model", f"{name!r} is not a causal LM (its architectures: {arch})"
            )
        if weights and not any(
            (path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")
        ):
            raise ConfigError(
                "init_model",
                f"{name!r} has no tokenizer (tokenizer.json); save one with "
                "`tokenizer.save_pretrained` next to the model",
            )
        _check_architecture(name, config)
        if weights:
            _check_shards(path)
        return
    if not _HUB_ID.match(name) or name.startswith((".", "/", "~")):
        raise ConfigError("init_model", f"{name!r} does not exist (and is not a hub id)")
    if hub_reachable():
        return
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(name, "config.json"), str):
        raise ConfigError(
            "init_model",
            f"{name!r} is not a local folder, the hub cannot be reached (no network or "
            "HF_HUB_OFFLINE set) and it is not in the hub cache",
        )
    _go_offline()


def _check_architecture(name: str, config: dict[str, Any]) -> None:
    """The folder's `model_type` / `architectures` must be a causal LM transformers has."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    known = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) if model_type else None
    names = {known} if isinstance(known, str) else set(known or ())
    arch = config.get("architectures") or []
    if not names or not any(a in names for a in arch):
        raise ConfigError(
            "init_model",
            f"{name!r} holds an unsupported architecture ({', '.join(map(str, arch))}, "
            f"model_type {model_type!r}): this transformers has no such causal LM; use a "
            "Llama-family checkpoint (e.g. Llama, Mistral, Qwen2)",
        )


def _check_shards(path: Path) -> None:
    """Every weight file the folder's index lists exists (or the single `model.safetensors`)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as err:
            raise ConfigError("init_model", f"{index} is not a weight index: {err!r}") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ConfigError(
                "init_model",
                f"{path} lacks {len(missing)} of the {len(shards)} weight shards its "
                f"model.safetensors.index.json lists: {', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}; copy the whole checkpoint folder",
            )
        return
    if not (path / "model.safetensors").is_file():
        raise ConfigError(
            "init_model",
            f"{path} has no weights (model.safetensors, or model.safetensors.index.json and "
            "its shards); leanlm reads safetensors checkpoints",
        )


def check_hub_dataset(config: RunConfig) -> None:
    """With no network, a hub dataset is read from the cache only (no retries; see `data`)."""
    data = config.data
    if data.source == "hub" and not Path(data.hub_name).exists() and not hub_reachable():
        _go_offline()
