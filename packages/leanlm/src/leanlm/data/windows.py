"""Token streams: a corpus tokenized whole, cut into blocks and windows, and the block order.

Training blocks, evenly spread validation windows and the seeded global-batch order that the
trainer and the distillation helpers share.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch

from leanlm.data.corpus import Corpus


@dataclass(frozen=True)
class TokenStreams:
    """Each split tokenized and concatenated (EOS after every row) into one 1-D int64 tensor."""

    train: torch.Tensor
    validation: torch.Tensor


def tokenize_corpus(corpus: Corpus, tokenizer: Any, *, tokenizer_key: str) -> TokenStreams:
    """Tokenize both splits with `tokenizer` (a fast HF tokenizer), cached by `datasets`.

    The cache entry is named by the corpus and tokenizer fingerprints, so a second run (or a
    second process, after the first) reads the token ids instead of tokenizing again.
    """
    dataset = corpus.dataset
    assert isinstance(dataset, datasets.DatasetDict), "a stream is tokenized by leanlm.data.stream"
    eos = tokenizer.eos_token_id

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [[*row, eos] for row in ids]}

    streams = {}
    for split in ("train", "validation"):
        tokenized = dataset[split].map(
            encode,
            batched=True,
            remove_columns=dataset[split].column_names,
            new_fingerprint=hashlib.sha256(
                f"leanlm:{corpus.fingerprint}:{tokenizer_key}:{split}".encode()
            ).hexdigest()[:32],
            desc=f"tokenizing {split}",
        )
        rows = tokenized.with_format("numpy")["input_ids"]
        flat = np.concatenate(list(rows)) if len(rows) else np.zeros(0, dtype=np.int64)
        streams[split] = torch.from_numpy(flat.astype(np.int64))
    return TokenStreams(train=streams["train"], validation=streams["validation"])


def blocks(stream: torch.Tensor, seq_len: int, *, limit: int = 0) -> torch.Tensor:
    """Cut a token stream into non-overlapping windows `(N, seq_len)`; drops the ragged tail.

    Args:
        stream: 1-D token ids.
        seq_len: window length.
        limit: keep at most this many windows (0 = all).

    Raises:
        ValueError: if the stream is shorter than one window.
    """
    n = stream.numel() // seq_len
    if n == 0:
        raise ValueError(
            f"a token stream of {stream.numel()} tokens is shorter than one window of "
            f"`data.seq_len` ({seq_len}) tokens; use more data or a shorter seq_len"
        )
    if limit:
        n = min(n, limit)
    return stream[: n * seq_len].view(n, seq_len)


def spread_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """`count` non-overlapping windows `(count, seq_len)` spread evenly over `stream`.

    Evenly spaced (first and last window included) rather than the first `count`, so a
    validation set of many files is scored on all of them, not on whichever comes first.
    `count` = 0 or more windows than the stream holds gives all of them.
    """
    every = blocks(stream, seq_len)
    if not count or count >= every.shape[0]:
        return every
    index = torch.linspace(0, every.shape[0] - 1, count).round().long()
    return every[index]


def selection_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """The `count - 1` windows halfway between consecutive `spread_windows(...)` windows.

    Disjoint from every window `spread_windows(stream, seq_len, count)` returns, so a choice
    made on them (a learning rate, a candidate shape) is not made on the windows it is
    reported on.

    Raises:
        ValueError: if `count` < 2 or `stream` holds fewer than `2 * count` windows.
    """
    every = blocks(stream, seq_len)
    if count < 2 or every.shape[0] < 2 * count:
        raise ValueError(
            f"`count` ({count}) must be >= 2 and the stream ({every.shape[0]} windows of "
            f"{seq_len}) must hold at least 2 x count windows for disjoint selection windows"
        )
    test = torch.linspace(0, every.shape[0] - 1, count).round().long()
    return every[(test[:-1] + test[1:]) // 2]


def global_batch_indices(
    step: int, *, global_batch: int, num_blocks: int, seed: int
) -> torch.Tensor:
    """Indices of the training blocks of optimizer step `step` (0-based), shape `(global_batch,)`.

    The order is a fresh permutation of all blocks each epoch, seeded by `(seed, epoch)`, so the
    batch of any step is a pure function of the step: resuming needs only the step number, and
    any number of processes sees the same global batch.
    """
    start = step * global_batch
    out = torch.empty(global_batch, dtype=torch.int64)
    filled = 0
    while filled < global_batch:
        epoch, offset = divmod(start + filled, num_blocks)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(num_blocks, generator=gen)
        take = min(global_batch - filled, num_blocks - offset)
        out[filled : filled + take] = perm[offset : offset + take]
        filled += take
    return out
