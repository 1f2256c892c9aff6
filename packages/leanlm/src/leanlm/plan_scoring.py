"""`leanlm plan`'s passes without gradients: importance scoring, sparsify's calibration, evaluation.

The stages' own library calls run on fake tensors at full size under `leanlm.plan`'s tracker:

- `prune`: `prune_distill.collect_importance` on one calibration batch (its statistics are
  running sums, so more batches hold no more memory), then the validation pass of the pruned
  model (`evaluate_perplexity`, one batch) with the input model still held;
- `sparsify`: `sparse_kernels.sparsify_` with every calibration batch (the sequential pass holds
  all their hidden states), then the one-shot validation pass (one batch).

Fake tensors have no values: a function that reads one on the host stops there
(`DataDependentOutputException`); `collect_importance` and `evaluate_perplexity` read only at
their end, after every pass, so their peak is complete. SparseGPT's solver reads its dampening
on the host before its work: it is planned by `_sparsegpt_allocations`, which makes the same
live tensors without the column loop.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from leanlm.config import RunConfig
from leanlm.plan_tracking import build, checkpoint_dtype, measure

TRAINING = ("pretrain", "control", "distill")
"""Stages that save their model in the training dtype (fp32)."""


def output_dtype(run: RunConfig, stage: str, base: Any) -> torch.dtype:
    """The dtype stage `stage` saves its model in (`"init"`: `init_model`'s checkpoint)."""
    if stage in TRAINING or (stage == "prune" and run.prune.search):
        return torch.float32
    if stage == "sparsify" and run.sparsify.steps:
        return torch.float32
    if stage in ("prune", "sparsify"):  # forward passes only: the input's dtype
        return input_dtype(run, stage, base)
    return checkpoint_dtype(base)


def input_dtype(run: RunConfig, stage: str, base: Any) -> torch.dtype:
    """The dtype stage `stage` loads the previous stage's model in (its checkpoint dtype)."""
    before = run.stages[: run.stages.index(stage)]
    return output_dtype(run, before[-1], base) if before else checkpoint_dtype(base)


def _autocast(run: RunConfig) -> Callable[[], Any]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(run.mixed_precision)
    return lambda: torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=bool(dtype))


def _ids(vocab: int, rows: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq_len))


@contextlib.contextmanager
def _until_host_read() -> Iterator[None]:
    """Stop quietly where the code reads a fake value on the host (see the module docstring)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    with contextlib.suppress(DataDependentOutputException):
        yield


def evaluate(run: RunConfig, model: Any, rows: int, vocab: int) -> None:
    """One validation pass of `rows` windows (fewer when the run has fewer windows)."""
    from leanlm.train.evaluate import evaluate_perplexity

    rows = min(rows, run.data.eval_windows or rows)
    windows = _ids(vocab, rows, run.data.seq_len)
    with _until_host_read():
        evaluate_perplexity(model, windows, batch_size=rows, autocast=_autocast(run))


def prune_phases(
    run: RunConfig, source: Any, student: Any, dtype: torch.dtype
) -> tuple[dict[str, dict[str, int]], int]:
    """The `scoring` and `evaluate` phases of the prune stage, and the input model's parameters.

    `source` and `student` are the transformers configs of the input and pruned models; both
    are held in `dtype` (the stage saves the pruned model in its input's dtype).
    """
    from prune_distill import collect_importance

    cfg = run.prune
    model = build(source, dtype).eval()
    vocab = source.vocab_size
    rows = min(cfg.calibration_batch_size, cfg.calibration_samples)
    batch = {"input_ids": _ids(vocab, rows, run.data.seq_len)}

    def score(tracker: Any) -> None:
        tracker.phase = "scoring"
        with _until_host_read():
            collect_importance(
                model, [batch], num_samples=None, layer_loss=cfg.layer_metric == "lm_loss"
            )

    phases = measure(score, [model])
    pruned = build(student, dtype).eval()

    def validate(tracker: Any) -> None:
        tracker.phase = "evaluate"
        evaluate(run, pruned, cfg.calibration_batch_size, vocab)

    phases |= measure(validate, [model, pruned])
    return phases, sum(p.numel() for p in model.parameters())


def sparsify_phases(run: RunConfig, config: Any, dtype: torch.dtype) -> dict[str, dict[str, int]]:
    """The `scoring` and `one_shot_evaluate` phases of the sparsify stage, in the input's dtype.

    The one-shot pruning with every calibration batch, then the one-shot validation pass.

    Beyond 3 calibration batches the pass runs with 2 and 3 and is extrapolated linearly to
    their number: each batch adds its hidden states and layer arguments, the same bytes for
    every full batch (a short last batch is planned full, a little over).
    """
    cfg = run.sparsify
    size = min(cfg.calibration_batch_size, cfg.calibration_samples)
    passes = math.ceil(cfg.calibration_samples / size)
    if passes <= 3:
        rows = [min(size, cfg.calibration_samples - i) for i in range(0, passes * size, size)]
        return _one_shot(run, config, dtype, rows)
    two, three = (_one_shot(run, config, dtype, [size] * k) for k in (2, 3))
    return {
        phase: {k: v + (three[phase][k] - v) * (passes - 2) for k, v in parts.items()}
        for phase, parts in two.items()
    }


def _one_shot(
    run: RunConfig, config: Any, dtype: torch.dtype, rows: list[int]
) -> dict[str, dict[str, int]]:
    from sparse_kernels import sparsify_

    cfg = run.sparsify
    model = build(config, dtype).eval()
    batches = [{"input_ids": _ids(config.vocab_size, n, run.data.seq_len)} for n in rows]
    sequential = cfg.sequential and cfg.method != "magnitude"

    def score(tracker: Any) -> None:
        tracker.phase = "scoring"
        with _sparsegpt_planned():
            sparsify_(model, cfg.sparsity_config, calibration=batches, sequential=sequential)
        tracker.phase = "one_shot_evaluate"
        evaluate(run, model, cfg.eval_batch_size, config.vocab_size)

    return measure(score, [model])


def _sparsegpt_planned() -> Any:
    """SparseGPT's solver replaced by `_sparsegpt_allocations` (see the module docstring)."""
    from unittest import mock

    import sparse_kernels.sparsify

    return mock.patch.object(sparse_kernels.sparsify, "sparsegpt_prune", _sparsegpt_allocations)


def _sparsegpt_allocations(
    weight: torch.Tensor, hessian: torch.Tensor, pattern: Any, **options: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_kernels.sparsegpt.sparsegpt_prune`'s live tensors on fake inputs, no values.

    It holds fp32 copies of the weight (rows, cols) and of the Hessian (cols, cols) to its end;
    inside the inverse, another Hessian copy, its Cholesky factor, the inverse and the inverse's
    upper factor (kept); then the mask, the working blocks of one column block (rows, block)
    and the update of the columns after it, (rows, cols - block) fp32.
    """
    rows, cols = weight.shape
    block = min(int(options.get("blocksize", 128)), cols)
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    inner = h.clone()
    factor = torch.linalg.cholesky(inner)
    inverse = torch.cholesky_inverse(factor)
    upper = torch.linalg.cholesky(inverse, upper=True)
    del inner, factor, inverse
    mask = torch.ones_like(w, dtype=torch.bool)
    work = [torch.zeros(rows, block) for _ in range(3)]
    keep = torch.zeros(rows, block, dtype=torch.bool)
    update = work[2] @ upper[:block, block:]
    del update, keep, work, upper, h
    return (w * mask).to(weight.dtype), mask
