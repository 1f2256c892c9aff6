"""A byte-level BPE trained with `tokenizers`, wrapped for transformers, cached on disk."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from leanlm.config import TokenizerConfig
from leanlm.data.corpus import Corpus

EOS = "<|endoftext|>"
"""Separates documents; also the BOS token."""
PAD = "<|pad|>"
"""Padding (never trained on)."""


def tokenizer_key(config: TokenizerConfig, corpus_fingerprint: str) -> str:
    """The cache key of a tokenizer: corpus, settings and the `tokenizers` version."""
    payload = json.dumps(
        {
            "corpus": corpus_fingerprint,
            "vocab_size": config.vocab_size,
            "min_frequency": config.min_frequency,
            "specials": [EOS, PAD],
            "tokenizers": tokenizers.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def train_tokenizer(texts: Iterator[list[str]], config: TokenizerConfig) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (GPT-2 style pre-tokenization) on batches of text.

    Every byte is in the initial alphabet, so any text encodes without unknown tokens.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD
    )


def _batches(corpus: Corpus, batch_size: int = 256) -> Iterator[list[str]]:
    # `iter` reads a loaded split and a stream (`[data] streaming`) alike, in order
    for batch in corpus.dataset["train"].iter(batch_size=batch_size):
        yield batch["text"]


def load_or_train_tokenizer(
    corpus: Corpus, config: TokenizerConfig, *, cache_dir: Path
) -> tuple[Any, str]:
    """The tokenizer for `corpus` and `config`, trained on the train split once and cached.

    The cache lives in `cache_dir/tokenizers/<key>/` (a `save_pretrained` folder) and is written
    to a temporary folder first, then renamed, so a crash never leaves a half-written entry.

    Returns:
        `(tokenizer, key)`: a fast transformers tokenizer and its cache key.
    """
    key = tokenizer_key(config, corpus.fingerprint)
    target = cache_dir / "tokenizers" / key
    if not (target / "tokenizer.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tokenizer = train_tokenizer(_batches(corpus), config)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race: keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(target), key
