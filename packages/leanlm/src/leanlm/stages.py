"""The stage interface: what every pipeline stage receives, returns and writes.

A stage is a class registered with `@register_stage` that has a `name` (also its config section
in `RunConfig` and its folder in the run directory) and a `run(ctx) -> StageResult` method. It
reads the previous stage's Hugging Face model folder (`ctx.input_dir`, `None` for the first
stage), writes its own under `ctx.stage_dir / "model"` (`save_pretrained` + tokenizer), and
returns the numbers the report shows. The pipeline stores each result with a hash of everything
the stage depends on, so a finished stage is skipped on `--resume` unless its inputs changed.
Adding a stage (prune, distill, ...) takes a new module with a registered class, its config
section (a `RunConfig` field and an entry in `config.STAGE_NAMES`) and one import in
`pipeline.py` that registers it; the pipeline loop itself does not change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from accelerate import Accelerator

from leanlm.config import RunConfig
from leanlm.data import (
    Corpus,
    TokenStreams,
    blocks,
    load_corpus,
    spread_windows,
    tokenize_corpus,
)
from leanlm.tokenizer import load_or_train_tokenizer


def default_cache_dir() -> Path:
    """`$LEANLM_CACHE_DIR`, else `~/.cache/leanlm`."""
    env = os.environ.get("LEANLM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "leanlm"


class RunResources:
    """Data shared by the stages of one run, built lazily once per process.

    The main process builds each cache entry first (datasets cache, tokenizer, token ids); the
    others wait, then read it, so several processes never write the same cache at once.
    """

    def __init__(self, config: RunConfig, accelerator: Accelerator) -> None:
        self.config = config
        self.accelerator = accelerator
        self.cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir()

    @cached_property
    def corpus(self) -> Corpus:
        """The run's text (train / validation `datasets` splits)."""
        with self.accelerator.main_process_first():
            return load_corpus(self.config.data, cache_dir=self.cache_dir / "datasets")

    @cached_property
    def _tokenizer_and_key(self) -> tuple[Any, str]:
        if self.config.init_model:  # the model's own tokenizer, keyed by its content
            from transformers import AutoTokenizer

            with self.accelerator.main_process_first():
                tokenizer = AutoTokenizer.from_pretrained(self.config.init_model)
            if not tokenizer.is_fast or tokenizer.eos_token_id is None:
                raise ValueError(
                    f"`init_model` ({self.config.init_model!r}) needs a fast tokenizer with an "
                    "end-of-sequence token (documents are joined with it)"
                )
            content = tokenizer.backend_tokenizer.to_str()
            return tokenizer, hashlib.sha256(content.encode()).hexdigest()[:16]
        with self.accelerator.main_process_first():
            return load_or_train_tokenizer(
                self.corpus, self.config.tokenizer, cache_dir=self.cache_dir
            )

    @property
    def tokenizer(self) -> Any:
        """The run's fast tokenizer (trained on the train split, cached)."""
        return self._tokenizer_and_key[0]

    @cached_property
    def streams(self) -> TokenStreams:
        """Both splits as 1-D token streams."""
        tokenizer, key = self._tokenizer_and_key
        with self.accelerator.main_process_first():
            return tokenize_corpus(self.corpus, tokenizer, tokenizer_key=key)

    @cached_property
    def train_blocks(self) -> torch.Tensor:
        """Training sequences `(N, seq_len)`."""
        return blocks(self.streams.train, self.config.data.seq_len)

    @cached_property
    def validation_windows(self) -> torch.Tensor:
        """The validation windows `(N, seq_len)` every stage is scored on."""
        data = self.config.data
        return spread_windows(self.streams.validation, data.seq_len, data.eval_windows)


@dataclass
class StageContext:
    """Everything a stage needs."""

    config: RunConfig
    run_dir: Path
    stage_dir: Path
    """This stage's folder (`run_dir / name`): its `model/`, metrics, checkpoints."""
    input_dir: Path | None
    """The previous stage's model folder; `None` for the first stage."""
    outputs: dict[str, Path]
    """Model folders of the stages that ran before this one, by stage name."""
    accelerator: Accelerator
    resources: RunResources
    resume: bool
    """Continue from this stage's latest training checkpoint if there is one."""
    config_hash: str
    """Hash of everything this stage depends on (its checkpoints must carry the same)."""

    @property
    def model_dir(self) -> Path:
        """Where the stage writes its Hugging Face model (and tokenizer)."""
        return self.stage_dir / "model"


@dataclass(frozen=True)
class StageResult:
    """What a finished stage reports; stored as `<stage_dir>/result.json`."""

    stage: str
    config_hash: str
    model_dir: str
    """The stage's model folder, relative to the run directory (the run can be moved)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Report columns: `params`, `tokens`, `wall_time_s`, `tokens_per_s`, `val_loss`,
    `val_perplexity`, `peak_rss_mib` (a stage fills what applies)."""

    def save(self, stage_dir: Path) -> None:
        """Write `result.json` atomically (temp file + rename)."""
        stage_dir.mkdir(parents=True, exist_ok=True)
        tmp = stage_dir / "result.json.tmp"
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True))
        os.replace(tmp, stage_dir / "result.json")

    @classmethod
    def load(cls, stage_dir: Path) -> StageResult | None:
        """The stored result of a finished stage, or `None`."""
        path = stage_dir / "result.json"
        if not path.is_file():
            return None
        return cls(**json.loads(path.read_text()))


class Stage(Protocol):
    """A pipeline stage (see the module docstring)."""

    name: ClassVar[str]

    def run(self, ctx: StageContext) -> StageResult:
        """Run the stage and return its result (the pipeline saves it)."""
        ...


STAGES: dict[str, type[Stage]] = {}
"""Registered stages by name."""


def register_stage(cls: type[Stage]) -> type[Stage]:
    """Class decorator that makes a stage available to `RunConfig.stages`."""
    if cls.name in STAGES:
        raise ValueError(f"a stage named {cls.name!r} is already registered: {STAGES[cls.name]}")
    STAGES[cls.name] = cls
    return cls
