"""`leanlm plan`: each configured stage's peak memory per process, planned at full size on a CPU.

Why: a user learns whether a run fits before renting GPUs. Models are built from `config.json`
alone under `FakeTensorMode` (shapes and dtypes, no data), and each stage runs its memory-heavy
passes with the run's settings while torch's `MemTracker` counts live bytes by kind: training
stages a warm step and a validation pass; `prune` importance scoring and the pruned model's
validation; `sparsify` the one-shot pass (`leanlm.plan_scoring`) and its fine-tune step. A
stage's peak is its largest phase. One process is planned: engines' sharding is shard-zero's
simulator's job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch

from leanlm.config import RunConfig, TrainConfig
from leanlm.plan_scoring import evaluate, input_dtype, output_dtype, prune_phases, sparsify_phases
from leanlm.plan_tracking import build, fake_tensors, measure, nbytes

PARTS = (
    "weights",
    "gradients",
    "optimizer_state",
    "activations",
    "teacher",
    "cache_buffers",
    "other",
)
"""What a stage's peak is made of (bytes per process at the peak, by `MemTracker`'s labels):
`activations` include the step's temporaries, `other` buffers and unlabelled tensors."""


@dataclasses.dataclass
class StagePlan:
    """One stage's planned peak (bytes per process) and what makes it up at that moment."""

    peak_bytes_per_process: int
    parts: dict[str, int]
    model_params: int
    """Parameters of the model the stage holds (the student for `distill`)."""
    note: str = ""
    peak_phase: str = ""
    """Where the peak falls: `forward`, `backward`, `optimizer` (a training step), `scoring`
    (importance scoring or one-shot pruning), `evaluate` (a validation pass; `one_shot_evaluate`:
    sparsify's before its fine-tune)."""
    phases: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict, repr=False)
    """Each phase's own peak: `total` and the parts (what `plan_stage` extrapolates)."""

    def as_dict(self) -> dict[str, Any]:
        """The JSON entry: the peak, its parts, the model's parameters and the note.

        Also each phase's peak with its parts (`phases`) and, for `prune` and `sparsify`,
        `scoring_peak_bytes_per_process`.
        """
        scoring = self.phases.get("scoring", {}).get("total")
        return {
            "peak_bytes_per_process": self.peak_bytes_per_process,
            **self.parts,
            "model_params": self.model_params,
            "peak_phase": self.peak_phase,
            "note": self.note,
            **({} if scoring is None else {"scoring_peak_bytes_per_process": scoring}),
            "phases": {
                phase: {"peak_bytes_per_process": parts["total"]}
                | {k: parts.get(k, 0) for k in PARTS}
                for phase, parts in self.phases.items()
            },
        }


def model_config(config: RunConfig) -> Any:
    """The model's transformers config: `init_model`'s `config.json`, or `[model]`."""
    if config.init_model:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(config.init_model)  # config.json only
    from leanlm.train.model import llama_config

    vocab = config.tokenizer.vocab_size
    return llama_config(config.model, vocab_size=vocab, bos_id=0, eos_id=1, pad_id=2)


def student_config(config: RunConfig, base: Any) -> Any:
    """`base` with the `[prune]` sizes (when `prune` runs), the head width kept."""
    cfg = base.__class__.from_dict(base.to_dict())
    if "prune" in config.stages:
        cfg.head_dim = getattr(base, "head_dim", None) or (
            base.hidden_size // base.num_attention_heads
        )
        for name in ("hidden_size", "intermediate_size", "num_attention_heads"):
            setattr(cfg, name, getattr(config.prune, name) or getattr(base, name))
        cfg.num_key_value_heads = config.prune.num_key_value_heads or base.num_key_value_heads
        cfg.num_hidden_layers = config.prune.num_hidden_layers or base.num_hidden_layers
    return cfg


def _with_layers(cfg: Any, layers: int) -> Any:
    out = cfg.__class__.from_dict(cfg.to_dict())
    out.num_hidden_layers = layers
    return out


PLAN_CPU_CHUNK = 1 << 22
"""`optim_adafactor.factored.CPU_CHUNK` while a plan runs an optimizer step (4x the default)."""


def _train_step(
    run: RunConfig,
    cfg: TrainConfig,
    model: Any,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    *,
    vocab: int,
    extra: list[Any],
) -> dict[str, dict[str, int]]:
    from leanlm.train.model import enable_activation_checkpointing
    from leanlm.train.optim import decay_param_groups, optimizer_over

    if cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    groups = decay_param_groups(model.parameters(), cfg.weight_decay)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # a constructor may draw a real seed (`.item()`)
        optimizer = optimizer_over(
            cfg.optimizer, groups, lr=cfg.lr, betas=cfg.betas, state_dtype=cfg.state_dtype
        )
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(run.mixed_precision)

    def step(tracker: Any = None) -> None:
        def phase(name: str) -> None:
            if tracker is not None:
                tracker.phase = name

        # the second micro-batch already finds every gradient allocated (accumulated in place):
        # later ones repeat its memory, so at most two run
        for _ in range(min(cfg.grad_accum_steps, 2)):
            if tracker is not None:
                tracker.reset_mod_stats()  # MemTracker's rule for a repeated forward
            phase("forward")
            ids = torch.randint(0, vocab, (cfg.micro_batch_size, run.data.seq_len))
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=bool(autocast)):
                loss = loss_fn(model, ids)
            phase("backward")
            loss.backward()  # type: ignore[no-untyped-call]
        phase("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if tracker is not None:  # a validation pass, the optimizer state held
            phase("evaluate")
            evaluate(run, model, cfg.eval_batch_size, vocab)

    from optim_adafactor import factored

    # CAME's and Adafactor's PyTorch path sweeps a CPU tensor in row chunks, a few dozen fake
    # ops per chunk: 4x fewer, 4x larger chunks plan 3.4x faster (8B recipe, 2 layers, distill)
    # and add 12 MB of workspace to a phase of 12 GB (the GPU kernels keep no such workspace)
    with mock.patch.object(factored, "CPU_CHUNK", PLAN_CPU_CHUNK):
        step()  # warm-up: the optimizer state exists from now on
        return measure(step, [model, optimizer, *extra])


def _lm_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    from leanlm.train.evaluate import causal_lm_loss

    return causal_lm_loss(model, ids)


def _stage_step(run: RunConfig, name: str, base: Any, layers: int | None) -> StagePlan:
    """One stage at `layers` decoder layers (None: the model's own)."""
    student = student_config(run, base)
    teacher_cfg = base
    if layers is not None:
        student, teacher_cfg = _with_layers(student, layers), _with_layers(base, layers)
    vocab = base.vocab_size
    extra: dict[str, int] = {"teacher": 0, "cache_buffers": 0}
    note = ""
    with fake_tensors():
        if name in ("pretrain", "control"):
            model = build(_with_layers(base, layers) if layers else base, torch.float32)
            cfg = getattr(run, name)
            phases = _train_step(run, cfg, model, _lm_loss, vocab=vocab, extra=[])
        elif name == "prune":
            dtype = input_dtype(run, name, base)
            phases, n_params = prune_phases(run, teacher_cfg, student, dtype)
            note = (
                f"importance scoring (prune-distill's collect_importance) and the pruned "
                f"model's validation pass, in {str(dtype).removeprefix('torch.')}"
                + ("; the architecture search is not planned" if run.prune.search else "")
            )
        elif name in ("distill", "sparsify"):
            model = build(student, torch.float32)
            cfg = getattr(run, name)
            if name == "sparsify":
                from sparse_kernels import sparsify_

                dtype = input_dtype(run, name, base)
                phases = sparsify_phases(run, student, dtype)
                note = (
                    f"one-shot {cfg.method} with {cfg.calibration_samples} calibration "
                    f"sequences and its validation pass in {str(dtype).removeprefix('torch.')}"
                )
                if cfg.steps:
                    # magnitude masks: the same bytes as any method's, no calibration data
                    sparsify_(model, dataclasses.replace(cfg.sparsity_config, method="magnitude"))
                    phases |= _train_step(run, cfg, model, _lm_loss, vocab=vocab, extra=[])
                    note += "; the sparse fine-tune step (fp32, masks held)"
            elif cfg.teacher == "cached":
                from leanlm.train.distill import cached_distillation_loss

                k = min(cfg.top_k or vocab, vocab)
                topk = (cfg.micro_batch_size, run.data.seq_len, k)
                cache = _FakeCache(topk)
                extra["cache_buffers"] = nbytes(cache.lookup(torch.empty(0)))
                loss_fn = cached_distillation_loss(cache, cfg)  # type: ignore[arg-type]
                phases = _train_step(run, cfg, model, loss_fn, vocab=vocab, extra=[])
                note = f"cached teacher: top-{k} logits of one micro-batch on the device"
            else:
                from leanlm.train.distill import distillation_loss

                teacher = build(teacher_cfg, output_dtype(run, cfg.teacher_stage, base))
                teacher = teacher.eval().requires_grad_(False)
                extra["teacher"] = nbytes(teacher.parameters())
                loss_fn = distillation_loss(teacher, cfg)
                phases = _train_step(run, cfg, model, loss_fn, vocab=vocab, extra=[teacher])
                note = "online teacher in its checkpoint dtype"
        else:
            raise ValueError(f"`leanlm plan` does not know stage {name!r}")
        if name != "prune":
            n_params = sum(p.numel() for p in model.parameters())
    for phase, parts in phases.items():
        # MemTracker counts the teacher's weights among the weights and the cache buffers (made
        # in the loss, held until its backward) among the activations: report them apart
        buffers = extra["cache_buffers"] if phase in ("forward", "backward") else 0
        parts["weights"] -= extra["teacher"]
        parts["activations"] -= buffers
        parts.update(extra, cache_buffers=buffers)
    return _at_peak(phases, n_params, note)


def _at_peak(phases: dict[str, dict[str, int]], n_params: int, note: str) -> StagePlan:
    peak = max(phases, key=lambda name: phases[name]["total"])
    parts = {k: phases[peak].get(k, 0) for k in PARTS}
    return StagePlan(phases[peak]["total"], parts, n_params, note, peak, phases)


@dataclasses.dataclass
class _FakeCache:
    """A `CachedTeacher` stand-in: new top-k buffers per micro-batch, as the real one reads."""

    shape: tuple[int, int, int]

    def lookup(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(self.shape), torch.empty(self.shape, dtype=torch.int64)


def plan_stage(run: RunConfig, name: str, *, layers: tuple[int, int] | None = None) -> StagePlan:
    """Stage `name`'s planned peak, at full depth or extrapolated from two smaller depths.

    With `layers = (a, b)` the stage runs at a and b decoder layers and the result is
    extrapolated linearly to the model's depth.

    Why linear: every decoder layer has the same shapes, so each adds the same parameter,
    gradient and optimizer-state bytes, the same saved activations (its input alone under
    activation checkpointing) and the same importance statistics; embeddings, head, logits and
    loss do not depend on depth. So each phase's peak (forward, backward, optimizer step) is
    affine in the depth; the phases are extrapolated apart, and the plan is the largest one
    (the overall peak may fall in another phase at a few layers than at the full depth).
    `test_plan` checks this against full fake runs.
    """
    base = model_config(run)
    if layers is None:
        return _stage_step(run, name, base, None)
    a, b = layers
    first, second = _stage_step(run, name, base, a), _stage_step(run, name, base, b)
    shaped = student_config(run, base) if name in ("distill", "sparsify") else base
    depth = int(shaped.num_hidden_layers)

    def extend(x: int, y: int) -> int:
        return x + (y - x) * (depth - a) // (b - a)

    phases = {
        phase: {k: extend(v, second.phases[phase][k]) for k, v in parts.items()}
        for phase, parts in first.phases.items()
    }
    note = (first.note + "; " if first.note else "") + f"extrapolated from {a} and {b} layers"
    return _at_peak(phases, extend(first.model_params, second.model_params), note)


def plan(run: RunConfig, *, layers: tuple[int, int] | None = None) -> dict[str, StagePlan]:
    """Every configured stage's plan, in run order."""
    return {name: plan_stage(run, name, layers=layers) for name in run.stages}
