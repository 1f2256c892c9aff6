"""Offline distillation: cache the teacher's top-k logits to disk once, distill from the files.

Each calibration/training batch becomes one file ``<index>.pt`` holding the batch's tensors plus
``teacher_topk_values`` (B, S, k), ``teacher_topk_indices`` (B, S, k) and ``teacher_vocab_size``
(a 0-d int64 tensor: the teacher's vocabulary size). `distill` uses those keys instead of running
a teacher, so the teacher never needs to be in memory during training, and refuses a cache whose
vocabulary size is not the student's.
Minitron saw quality losses with k <= 100; k = vocab size reproduces online distillation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prune_distill.arch import model_device
from prune_distill.config import _check_int
from prune_distill.importance import model_inputs
from prune_distill.losses import check_topk, check_vocab

TOPK_VALUES = "teacher_topk_values"
TOPK_INDICES = "teacher_topk_indices"
TEACHER_VOCAB = "teacher_vocab_size"


@torch.no_grad()
def cache_teacher_topk(
    teacher: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    directory: str | Path,
    *,
    top_k: int,
    values_dtype: torch.dtype = torch.float32,
) -> TeacherCache:
    """Run `teacher` over `batches` and write each batch with its top-k logits to `directory`.

    Args:
        teacher: the teacher causal LM (eval mode is used; its mode is restored).
        batches: dicts with ``input_ids`` (B, S) and optional ``attention_mask`` / ``labels``.
        directory: created if missing; must not already hold cache files.
        top_k: logits kept per token, an int >= 1 (capped at the vocabulary size); anything
            else (None, a bool, a float) raises a ValueError naming `top_k`.
        values_dtype: storage dtype of the logit values (bf16 halves the files).

    Returns:
        The cache, iterable as batches for `distill(student, None, cache, config)`.
    """
    _check_int("top_k", top_k)  # "`top_k` (None) must be an int >= 1", as DistillConfig's
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    if any(path.glob("*.pt")):
        raise ValueError(f"`directory` ({path}) already holds .pt files; use an empty directory")
    device = model_device(teacher)
    was_training = teacher.training
    teacher.eval()
    try:
        for i, batch in enumerate(batches):
            inputs = {
                k: v.to(device) if isinstance(v, torch.Tensor) else v
                for k, v in model_inputs(batch).items()
            }
            logits = teacher(**inputs, use_cache=False).logits
            values, indices = torch.topk(logits, min(int(top_k), logits.shape[-1]), dim=-1)
            record = {k: v.cpu() for k, v in batch.items() if isinstance(v, torch.Tensor)}
            record[TOPK_VALUES] = values.to("cpu", values_dtype)
            record[TOPK_INDICES] = indices.to("cpu", torch.int32)
            record[TEACHER_VOCAB] = torch.tensor(logits.shape[-1], dtype=torch.int64)
            torch.save(record, path / f"{i:08d}.pt")
    finally:
        teacher.train(was_training)
    return TeacherCache(path)


def check_cached_vocab(batch: Mapping[str, Any], vocab: int) -> None:
    """Raise a ValueError unless the teacher of a cached batch had the student's `vocab`.

    Compares the teacher vocabulary size the batch records (`check_vocab`), read from the batch
    as yielded: on the CPU for a `TeacherCache`, so no host sync. A cache written before the size
    was recorded has its indices checked to lie below `vocab` instead (`check_topk`, on the CPU
    only), which catches a larger teacher vocabulary but not a smaller one.
    """
    recorded = batch.get(TEACHER_VOCAB)
    if isinstance(recorded, torch.Tensor):
        check_vocab(int(recorded), vocab)
    else:
        check_topk(batch[TOPK_VALUES], batch[TOPK_INDICES], vocab)


class TeacherCache:
    """The batches written by `cache_teacher_topk`, read back in order (re-iterable)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.files = sorted(self.directory.glob("*.pt"))
        if not self.files:
            raise ValueError(f"`directory` ({self.directory}) holds no cached batches")

    def __len__(self) -> int:
        return len(self.files)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for file in self.files:
            record = torch.load(file, weights_only=True)
            assert isinstance(record, dict)
            yield record
