"""Logit distillation of a (pruned) student from a frozen teacher.

Defaults follow Minitron (arXiv 2407.14679, Sec. 3 and Table 15): forward KL on the logits at
temperature 1, no cross-entropy term, AdamW. The teacher runs under ``torch.no_grad`` in eval mode
(its weights and mode are left as they were); its logits can be cut to their top-k to save memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prune_distill._arch import model_device
from prune_distill.cache import TOPK_INDICES, TOPK_VALUES
from prune_distill.importance import lm_targets, model_inputs
from prune_distill.losses import TopK, forward_kl

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """How `distill` trains the student."""

    temperature: float = 1.0
    """Softmax temperature T of the KL term (the loss is scaled by T^2). Minitron: 1."""
    kl_weight: float = 1.0
    """Weight of the forward KL(teacher || student) term."""
    lm_loss_weight: float = 0.0
    """Weight of the student's next-token cross-entropy (Minitron: 0, KL only)."""
    top_k: int | None = None
    """Keep only the teacher's top-k logits (renormalised); None uses the full vocabulary.
    Minitron saw quality losses for k <= 100."""
    chunk_size: int | None = 1024
    """Token rows per chunk of the memory-lean KL; None uses plain autograd."""
    lr: float = 1e-4
    """Learning rate of the default AdamW."""
    weight_decay: float = 0.0
    """Weight decay of the default AdamW."""
    optimizer: OptimizerFactory | None = None
    """Builds the optimizer from the student's trainable parameters; None: AdamW(lr, wd)."""
    scheduler: SchedulerFactory | None = None
    """Builds an LR scheduler from the optimizer, stepped once per optimizer step."""
    grad_accumulation_steps: int = 1
    """Micro-batches per optimizer step (a trailing partial group is stepped, rescaled)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps; None runs through `batches` once."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm; None disables clipping."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"`temperature` ({self.temperature}) must be > 0")
        if self.kl_weight < 0 or self.lm_loss_weight < 0:
            raise ValueError(
                f"`kl_weight` ({self.kl_weight}) and `lm_loss_weight` ({self.lm_loss_weight}) "
                "must be >= 0"
            )
        if self.kl_weight == 0 and self.lm_loss_weight == 0:
            raise ValueError("`kl_weight` and `lm_loss_weight` are both 0: nothing to train on")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"`top_k` ({self.top_k}) must be >= 1 or None")
        if self.grad_accumulation_steps < 1:
            raise ValueError(
                f"`grad_accumulation_steps` ({self.grad_accumulation_steps}) must be >= 1"
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"`max_steps` ({self.max_steps}) must be >= 1 or None")


@dataclass
class DistillResult:
    """What happened during `distill`, one entry per optimizer step."""

    losses: list[float] = field(default_factory=list)
    """Total loss (weighted KL + weighted CE), mean over the step's micro-batches."""
    kl: list[float] = field(default_factory=list)
    """KL term (unweighted), mean over the step's micro-batches."""
    lm_loss: list[float] = field(default_factory=list)
    """Student cross-entropy (unweighted; computed only when `lm_loss_weight` > 0, else NaN)."""
    tokens: int = 0
    """Non-padding tokens the student trained on."""

    @property
    def steps(self) -> int:
        """Optimizer steps taken."""
        return len(self.losses)


def _move(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _teacher_logits(
    teacher: nn.Module | None, batch: Mapping[str, Any], device: torch.device, top_k: int | None
) -> torch.Tensor | TopK:
    if TOPK_VALUES in batch:  # offline: cached by `cache_teacher_topk`
        values, indices = batch[TOPK_VALUES], batch[TOPK_INDICES]
        if top_k is not None:
            values, indices = values[..., :top_k], indices[..., :top_k]
        return values.to(device), indices.to(device)
    if teacher is None:
        raise ValueError(
            "`teacher` is None but the batch holds no cached teacher logits: pass a teacher "
            "model, or batches from `cache_teacher_topk` / `TeacherCache`"
        )
    with torch.no_grad():
        inputs = _move(model_inputs(batch), model_device(teacher))
        logits = teacher(**inputs, use_cache=False).logits
        if top_k is not None:
            values, indices = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1)
            return values.to(device), indices.to(device)
        dense: torch.Tensor = logits.to(device)
        return dense


def distill(
    student: nn.Module,
    teacher: nn.Module | None,
    batches: Iterable[Mapping[str, Any]],
    config: DistillConfig | None = None,
) -> DistillResult:
    """Train `student` in place to match `teacher`'s next-token distributions on `batches`.

    Args:
        student: the model to train (e.g. the output of `prune`); trained on its own device.
        teacher: a causal LM with the same vocabulary, on any device and dtype (bf16 is fine);
            frozen: run without gradients in eval mode, its mode restored afterwards. None for
            offline distillation from batches holding cached teacher top-k logits.
        batches: iterable of dicts with ``input_ids`` (B, S), optional ``attention_mask`` (padding
            is excluded from both losses), optional ``labels`` (for the CE term) and, offline,
            ``teacher_topk_values`` / ``teacher_topk_indices`` (see `cache_teacher_topk`).
        config: loss, optimizer and loop settings; None uses `DistillConfig()`.

    Returns:
        Per-step losses. The student keeps its train/eval mode from before the call.
    """
    cfg = config or DistillConfig()
    device = model_device(student)
    params = [p for p in student.parameters() if p.requires_grad]
    if not params:
        raise ValueError("`student` has no parameters with requires_grad=True")
    if cfg.optimizer is not None:
        opt = cfg.optimizer(params)
    else:
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = cfg.scheduler(opt) if cfg.scheduler is not None else None

    result = DistillResult()
    student_was_training = student.training
    teacher_was_training = teacher.training if teacher is not None else False
    student.train()
    if teacher is not None:
        teacher.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # total, kl, ce of this step
    micro = 0
    try:
        opt.zero_grad(set_to_none=True)
        for raw in batches:
            batch = _move(raw, device)
            mask = batch.get("attention_mask")
            target = _teacher_logits(teacher, batch, device, cfg.top_k)
            logits = student(**model_inputs(batch), use_cache=False).logits
            kl = forward_kl(
                logits, target, mask=mask, temperature=cfg.temperature, chunk_size=cfg.chunk_size
            )
            loss = cfg.kl_weight * kl
            ce = torch.full((), float("nan"), device=device)
            if cfg.lm_loss_weight > 0:
                targets = lm_targets(batch)
                ce = F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                    targets.reshape(-1),
                    ignore_index=-100,
                )
                loss = loss + cfg.lm_loss_weight * ce
            (loss / cfg.grad_accumulation_steps).backward()  # type: ignore[no-untyped-call]
            sums += torch.stack([loss.detach(), kl.detach(), ce.detach()]).double()
            result.tokens += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
            micro += 1
            if micro == cfg.grad_accumulation_steps:
                _step(
                    opt=opt,
                    sched=sched,
                    params=params,
                    cfg=cfg,
                    micro=micro,
                    sums=sums,
                    result=result,
                )
                micro = 0
                if cfg.max_steps is not None and result.steps >= cfg.max_steps:
                    break
        if micro:
            _step(
                opt=opt, sched=sched, params=params, cfg=cfg, micro=micro, sums=sums, result=result
            )
    finally:
        opt.zero_grad(set_to_none=True)
        student.train(student_was_training)
        if teacher is not None:
            teacher.train(teacher_was_training)
    return result


def _step(
    *,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler | None,
    params: list[nn.Parameter],
    cfg: DistillConfig,
    micro: int,
    sums: torch.Tensor,
    result: DistillResult,
) -> None:
    if micro != cfg.grad_accumulation_steps:  # a trailing partial group: mean over what ran
        for p in params:
            if p.grad is not None:
                p.grad.mul_(cfg.grad_accumulation_steps / micro)
    if cfg.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
    opt.step()
    if sched is not None:
        sched.step()
    opt.zero_grad(set_to_none=True)
    total, kl, ce = (sums / micro).tolist()  # one host sync per optimizer step
    result.losses.append(total)
    result.kl.append(kl)
    result.lm_loss.append(ce)
    sums.zero_()


@torch.no_grad()
def evaluate_kl(
    student: nn.Module,
    teacher: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    *,
    temperature: float = 1.0,
) -> float:
    """Token-weighted mean forward KL(teacher || student) on `batches` (eval mode, no grads)."""
    device = model_device(student)
    was = student.training, teacher.training
    student.eval()
    teacher.eval()
    total, count = 0.0, 0
    try:
        for raw in batches:
            batch = _move(raw, device)
            mask = batch.get("attention_mask")
            n = int(mask.sum()) if mask is not None else batch["input_ids"].numel()
            target = _teacher_logits(teacher, batch, device, None)
            logits = student(**model_inputs(batch), use_cache=False).logits
            kl = forward_kl(logits, target, mask=mask, temperature=temperature, chunk_size=None)
            total += float(kl) * n
            count += n
    finally:
        student.train(was[0])
        teacher.train(was[1])
    if count == 0:
        raise ValueError("`batches` yielded no tokens")
    return total / count
