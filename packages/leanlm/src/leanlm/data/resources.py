"""Data shared by the stages of one run: corpus, tokenizer, token streams, blocks, windows."""

from __future__ import annotations

import hashlib
import os
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator

from leanlm.config import ConfigError
from leanlm.data import (
    Corpus,
    TokenStreams,
    blocks,
    load_corpus,
    spread_windows,
    tokenize_corpus,
)
from leanlm.data.stream import (
    BatchSource,
    BlockBatches,
    StreamBatches,
    WindowStream,
    first_windows,
)
from leanlm.data.tokenizer import load_or_train_tokenizer

if TYPE_CHECKING:
    from leanlm.config import RunConfig


def default_cache_dir() -> Path:
    """`$LEANLM_CACHE_DIR`, else `~/.cache/leanlm`."""
    env = os.environ.get("LEANLM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "leanlm"


def validation_key(config: RunConfig) -> tuple[str, Any]:
    """The config key that chooses the validation split of `config`'s corpus, and its value."""
    data = config.data
    if data.source == "files" and data.validation_files:
        return "data.validation_files", list(data.validation_files)
    if data.source == "hub":
        return "data.hub_validation_split", data.hub_validation_split
    return "data.validation_fraction", data.validation_fraction


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
        """Training sequences `(N, seq_len)` (not with `[data] streaming`)."""
        if self.config.data.streaming:
            raise ConfigError(
                "data.streaming",
                "(true) holds no training blocks in memory, and this stage needs them: "
                "run it with streaming = false",
            )
        return blocks(self.streams.train, self.config.data.seq_len)

    @cached_property
    def validation_windows(self) -> torch.Tensor:
        """The validation windows `(N, seq_len)` every stage is scored on.

        Spread evenly over the validation split; with `[data] streaming`, the first
        `eval_windows` windows of the validation stream (only those are tokenized). The pipeline
        builds them before the first stage.

        Raises:
            ConfigError: the validation split is shorter than one window, naming the key that
                chose it (`data.validation_files`, `data.validation_fraction` or
                `data.hub_validation_split`) and both lengths.
        """
        data = self.config.data
        try:
            if data.streaming:
                split = self.corpus.dataset["validation"]
                return first_windows(split, self.tokenizer, data.seq_len, data.eval_windows)
            return spread_windows(self.streams.validation, data.seq_len, data.eval_windows)
        except ConfigError:
            raise
        except ValueError as err:  # `blocks`: shorter than one window (names both lengths)
            key, value = validation_key(self.config)
            raise ConfigError(
                key, f"({value!r}) gives a validation split too short to score the stages on: {err}"
            ) from None

    def train_batches(self) -> BatchSource:
        """A new source of the trainer's global batches, at the start of the training data."""
        data = self.config.data
        if data.streaming:
            split = self.corpus.dataset["train"]
            return StreamBatches(WindowStream(split, self.tokenizer, data.seq_len))
        return BlockBatches(self.train_blocks, seed=self.config.seed)
