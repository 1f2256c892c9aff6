"""Logit distillation of a (pruned) student from a frozen teacher.

Defaults follow Minitron (arXiv 2407.14679, Sec. 3 and Table 15): forward KL on the logits at
temperature 1, no cross-entropy term, AdamW. The teacher runs under ``torch.no_grad`` in eval mode
(its weights and mode are left as they were); its logits can be cut to their top-k to save memory.
Optionally an intermediate hidden-state loss (`prune_distill.hidden`) is added, and
`correct_teacher` fine-tunes a copy of the teacher on the distillation data first (Minitron's
"teacher correction", arXiv 2408.11796) with this same loop.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prune_distill import _engine_optim
from prune_distill.arch import model_device
from prune_distill.cache import TEACHER_VOCAB, TOPK_INDICES, TOPK_VALUES, check_cached_vocab
from prune_distill.config import DistillConfig
from prune_distill.divergences import divergence
from prune_distill.hidden import HiddenStateLoss
from prune_distill.importance import lm_targets, many_batches, model_inputs
from prune_distill.losses import TopK, check_vocab, forward_kl

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


@dataclass
class DistillResult:
    """What happened during `distill`, one entry per optimizer step."""

    losses: list[float] = field(default_factory=list)
    """Total loss (weighted KL + weighted CE + weighted hidden-state loss) of the step's
    micro-batches, each term a mean over the valid tokens of the whole step (as one batch of the
    same sequences would give)."""
    kl: list[float] = field(default_factory=list)
    """Logit-loss term (`DistillConfig.loss`, by default the forward KL; unweighted), a mean over
    the valid tokens of the step's micro-batches."""
    lm_loss: list[float] = field(default_factory=list)
    """Student cross-entropy (unweighted; computed only when `lm_loss_weight` > 0, else NaN)."""
    hidden_loss: list[float] = field(default_factory=list)
    """Hidden-state loss (unweighted; computed only when `hidden_loss_weight` > 0, else NaN)."""
    tokens: int = 0
    """Non-padding tokens the student trained on."""
    projection: nn.Linear | None = None
    """The trained student -> teacher hidden-size map of the hidden-state loss (None when the
    loss is off or the widths are equal). It is not part of the student; keep it to resume."""

    @property
    def steps(self) -> int:
        """Optimizer steps taken."""
        return len(self.losses)


def _move(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


TeacherStates = tuple[torch.Tensor, ...]


def _teacher_logits(
    teacher: nn.Module | None, batch: Mapping[str, Any], device: torch.device, top_k: int | None
) -> torch.Tensor | TopK:
    target, _, _ = _teacher_outputs(teacher, batch, device, top_k)
    assert target is not None
    return target


def _teacher_outputs(
    teacher: nn.Module | None,
    batch: Mapping[str, Any],
    device: torch.device,
    top_k: int | None,
    *,
    hidden: bool = False,
    optional: bool = False,
) -> tuple[torch.Tensor | TopK | None, TeacherStates | None, int | None]:
    """Teacher logits (dense or top-k), its hidden states if `hidden` (on its device), its vocab.

    The vocabulary size is the teacher model's (None offline: `check_cached_vocab` reads the
    cache's). With `optional`, no teacher and no cached logits give Nones, not an error.
    """
    if TOPK_VALUES in batch:  # offline: cached by `cache_teacher_topk`
        if hidden:
            raise ValueError(
                "`hidden_loss_weight` > 0 needs the teacher's hidden states, but the batch holds "
                "cached top-k logits only (offline mode): distill online with a teacher model, "
                "or set `hidden_loss_weight` = 0"
            )
        values, indices = batch[TOPK_VALUES], batch[TOPK_INDICES]
        if top_k is not None:
            values, indices = values[..., :top_k], indices[..., :top_k]
        return (values.to(device), indices.to(device)), None, None
    if teacher is None:
        if optional:
            return None, None, None
        raise ValueError(
            "`teacher` is None but the batch holds no cached teacher logits: pass a teacher "
            "model, or batches from `cache_teacher_topk` / `TeacherCache`"
        )
    with torch.no_grad():
        inputs = _move(model_inputs(batch), model_device(teacher))
        out = teacher(**inputs, use_cache=False, output_hidden_states=hidden)
        states = tuple(out.hidden_states) if hidden else None
        logits = out.logits
        if top_k is not None:
            values, indices = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1)
            return (values.to(device), indices.to(device)), states, logits.shape[-1]
        dense: torch.Tensor = logits.to(device)
        return dense, states, logits.shape[-1]


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
            offline distillation from batches holding cached teacher top-k logits (not with the
            hidden-state loss), or for plain LM training when `kl_weight` is 0.
        batches: iterable of dicts with ``input_ids`` (B, S), optional ``attention_mask`` (padding
            is excluded from both losses), optional ``labels`` (for the CE term) and, offline,
            ``teacher_topk_values`` / ``teacher_topk_indices`` (see `cache_teacher_topk`).
        config: loss, optimizer and loop settings; None uses `DistillConfig()`.

    Returns:
        Per-step losses (and the hidden-state `projection`, if one was trained). The student
        keeps its train/eval mode from before the call.

    Raises:
        ValueError: no trainable parameters, no teacher where one is needed, a teacher (or
            cache) of another vocabulary size than the student's, a `hidden_layer_map`
            outside the models' layers, or an optimizer without the hidden-state projection.
        RuntimeError: no student parameter that the optimizer steps got a gradient in the
            first backward (an engine keeps them: pass its optimizer).
    """
    cfg = config or DistillConfig()
    many_batches(batches)
    device = model_device(student)
    params = [p for p in student.parameters() if p.requires_grad]
    if not params:
        raise ValueError("`student` has no parameters with requires_grad=True")
    hidden: HiddenStateLoss | None = None
    if cfg.hidden_loss_weight > 0:
        if teacher is None:
            raise ValueError(
                "`hidden_loss_weight` > 0 needs a teacher model (its hidden states are not "
                "cached offline); pass `teacher` or set `hidden_loss_weight` = 0"
            )
        hidden = HiddenStateLoss.between(
            student,
            teacher,
            cfg.hidden_layer_map,
            kind=cfg.hidden_loss_type,
            seed=cfg.hidden_projection_seed,
        )
    student_params = list(params)
    projection = list(hidden.parameters()) if hidden is not None else []  # widths differ
    params += projection
    opt = _engine_optim.build(cfg, student_params, projection)
    sched = cfg.scheduler(opt) if cfg.scheduler is not None else None

    result = DistillResult(projection=hidden.projection if hidden is not None else None)
    student_was_training = student.training
    teacher_was_training = teacher.training if teacher is not None else False
    student.train()
    if teacher is not None:
        teacher.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # total, kl, ce, hidden
    nan = torch.full((), float("nan"), device=device)
    teacher_optional = cfg.kl_weight == 0 and hidden is None
    pending = iter(batches)
    try:
        opt.zero_grad(set_to_none=True)
        # one accumulation group at a time: its token counts normalise every micro-batch's loss
        while group := list(itertools.islice(pending, cfg.grad_accumulation_steps)):
            counts = [_token_counts(raw, targets=cfg.lm_loss_weight > 0) for raw in group]
            group_tokens = max(sum(n for n, _ in counts), 1)
            group_targets = max(sum(n for _, n in counts), 1)
            for raw, (tokens, _) in zip(group, counts, strict=True):
                batch = _move(raw, device)
                share = tokens / group_tokens  # this micro-batch's mean -> its sum / group's
                mask = batch.get("attention_mask")
                target, teacher_states, teacher_vocab = _teacher_outputs(
                    teacher,
                    batch,
                    device,
                    cfg.top_k,
                    hidden=hidden is not None,
                    optional=teacher_optional,
                )
                out = student(
                    **model_inputs(batch), use_cache=False, output_hidden_states=hidden is not None
                )
                logits = out.logits
                if isinstance(target, tuple):  # the loss checks a dense teacher's vocabulary
                    if teacher_vocab is None:
                        check_cached_vocab(raw, logits.shape[-1])  # no host sync
                    else:
                        check_vocab(teacher_vocab, logits.shape[-1])
                loss, kl = torch.zeros((), device=device), nan
                if target is not None:  # None only for plain LM training (`correct_teacher`)
                    kl = share * divergence(
                        logits,
                        target,
                        loss=cfg.loss,
                        beta=cfg.beta,
                        mask=mask,
                        temperature=cfg.temperature,
                        chunk_size=cfg.chunk_size,
                        backend=cfg.kl_backend,
                    )
                    loss = cfg.kl_weight * kl
                hs = nan
                if hidden is not None:
                    assert teacher_states is not None
                    hs = share * hidden(out.hidden_states, teacher_states, mask)
                    loss = loss + cfg.hidden_loss_weight * hs
                ce = nan
                if cfg.lm_loss_weight > 0:
                    ce = F.cross_entropy(
                        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                        lm_targets(batch).reshape(-1),
                        ignore_index=-100,
                        reduction="sum",
                    )
                    ce = ce / group_targets
                    loss = loss + cfg.lm_loss_weight * ce
                loss.backward()  # type: ignore[no-untyped-call]
                sums += torch.stack([loss.detach(), kl.detach(), ce.detach(), hs.detach()]).double()
                result.tokens += tokens
            _step(
                opt=opt,
                sched=sched,
                params=params,
                student_params=student_params,
                cfg=cfg,
                sums=sums,
                result=result,
            )
            if cfg.max_steps is not None and result.steps >= cfg.max_steps:
                break
    finally:
        opt.zero_grad(set_to_none=True)
        student.train(student_was_training)
        if teacher is not None:
            teacher.train(teacher_was_training)
    if result.steps == 0:
        raise ValueError(
            "`batches` yielded no batch, so nothing was trained (an iterator used up by an "
            "earlier pass? pass a list, or a fresh iterable each time)"
        )
    return result


def correct_teacher(
    teacher: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    *,
    steps: int,
    lr: float = 1e-5,
    weight_decay: float = 0.0,
    optimizer: OptimizerFactory | None = None,
    scheduler: SchedulerFactory | None = None,
    grad_accumulation_steps: int = 1,
    max_grad_norm: float | None = 1.0,
) -> nn.Module:
    """Teacher correction: fine-tune a copy of `teacher` on the distillation data (LM loss).

    Minitron's second paper (arXiv 2408.11796) first fine-tunes the teacher on the data it will
    distill on, because a teacher trained on another distribution guides the student poorly. This
    runs `distill`'s loop with the next-token cross-entropy only (no teacher, no KL) on a deep copy
    of `teacher`, in the teacher's device and dtype, with every parameter trainable.

    Args:
        teacher: the causal LM to correct; not modified (weights, mode, ``requires_grad``).
        batches: the distillation batches (dicts as for `distill`; ``labels`` are honoured,
            padding is excluded, cached teacher logits are ignored).
        steps: optimizer steps (at most; fewer if `batches` runs out first).
        lr: learning rate of the default AdamW (NeMo's tutorial decays 1e-4 -> 1e-5).
        weight_decay: weight decay of the default AdamW.
        optimizer: optimizer factory over the parameters, as `DistillConfig.optimizer`.
        scheduler: LR scheduler factory, as `DistillConfig.scheduler`.
        grad_accumulation_steps: micro-batches per optimizer step.
        max_grad_norm: clip the global gradient norm; None disables clipping.

    Returns:
        The corrected copy, in eval mode, with the input's ``requires_grad`` flags. It holds a
        second set of weights: drop the original if memory is tight.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"`steps` ({steps!r}) must be an int >= 1")
    cfg = DistillConfig(
        kl_weight=0.0,
        lm_loss_weight=1.0,
        lr=lr,
        weight_decay=weight_decay,
        optimizer=optimizer,
        scheduler=scheduler,
        grad_accumulation_steps=grad_accumulation_steps,
        max_steps=steps,
        max_grad_norm=max_grad_norm,
    )
    corrected = copy.deepcopy(teacher)
    flags = [p.requires_grad for p in corrected.parameters()]
    corrected.requires_grad_(True)
    plain = (
        {k: v for k, v in b.items() if k not in (TOPK_VALUES, TOPK_INDICES, TEACHER_VOCAB)}
        for b in many_batches(batches)
    )
    try:
        distill(corrected, None, plain, cfg)
    finally:
        for p, flag in zip(corrected.parameters(), flags, strict=True):
            p.requires_grad_(flag)
    return corrected.eval()


def _token_counts(batch: Mapping[str, Any], *, targets: bool) -> tuple[int, int]:
    """Valid tokens of `batch` (KL and hidden-state loss) and, if `targets`, its CE targets."""
    mask = batch.get("attention_mask")
    tokens = int(mask.sum()) if mask is not None else batch["input_ids"].numel()
    return tokens, int((lm_targets(batch) != -100).sum()) if targets else 0


def _step(
    *,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler | None,
    params: list[nn.Parameter],
    student_params: list[nn.Parameter],
    cfg: DistillConfig,
    sums: torch.Tensor,
    result: DistillResult,
) -> None:
    if result.steps == 0:
        _engine_optim.check_gradients_reached(opt, student_params)
    if cfg.max_grad_norm is not None:
        _engine_optim.clip_(opt, params, cfg.max_grad_norm)
    opt.step()
    if sched is not None:
        sched.step()
    opt.zero_grad(set_to_none=True)
    total, kl, ce, hs = sums.tolist()  # one host sync per optimizer step
    result.losses.append(total)
    result.kl.append(kl)
    result.lm_loss.append(ce)
    result.hidden_loss.append(hs)
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
        for raw in many_batches(batches):
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
