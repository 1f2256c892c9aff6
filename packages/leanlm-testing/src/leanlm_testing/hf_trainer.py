"""HF `Trainer` checks for optimizers: a short run moves every weight; a resumed run is exact.

A run that saves, stops and resumes must equal one that did not.

Everything is built locally (a tiny Llama from a config, random token ids): no download.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from leanlm_testing.models import tiny_llama

#: Builds the Trainer's `optimizers=(optimizer, scheduler)` pair for a model (scheduler: None
#: lets the Trainer create its own from the TrainingArguments).
MakeOptimizers = Callable[[torch.nn.Module], tuple[torch.optim.Optimizer, Any]]


def token_dataset(
    vocab_size: int, *, rows: int = 12, seq_len: int = 16, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """`rows` random causal-LM examples (`input_ids` = `labels`), fixed by `seed`."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        ids = torch.randint(0, vocab_size, (seq_len,), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


@dataclass
class TrainerRun:
    """The end of one `Trainer.train()`: the trainer, its model and its (unwrapped) optimizer."""

    trainer: Any
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def _train(
    make_optimizers: MakeOptimizers,
    output_dir: str,
    *,
    steps: int,
    model_seed: int,
    save_steps: int | None = None,
    stop_at: int | None = None,
    resume_from: str | None = None,
    dtype: torch.dtype = torch.float32,
    args_overrides: dict[str, Any] | None = None,
) -> TrainerRun:
    import transformers

    class _StopAt(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if stop_at is not None and state.global_step >= stop_at:
                control.should_training_stop = True
            return control

    model = tiny_llama(seed=model_seed).to(dtype).train()
    args = transformers.TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        warmup_steps=2,
        lr_scheduler_type="cosine",
        report_to=[],
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        use_cpu=True,
        logging_steps=1,
        disable_tqdm=True,
        seed=7,
        data_seed=7,
        **(args_overrides or {}),
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=token_dataset(model.config.vocab_size),
        optimizers=make_optimizers(model),
        callbacks=[_StopAt()],
    )
    trainer.train(resume_from_checkpoint=resume_from)
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return TrainerRun(trainer=trainer, model=model, optimizer=opt)


def check_trainer_trains(
    optimizer: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    how: str,
    tmp_path: os.PathLike[str] | str,
    *,
    args_overrides: dict[str, Any] | None = None,
) -> TrainerRun:
    """4 `Trainer` steps of a tiny Llama with `optimizer(params, **kwargs)`; every weight moves.

    `how` is how the Trainer gets the optimizer: "optimizers" (an instance, the Trainer's own
    scheduler) or "optimizer_cls_and_kwargs" (the class and `kwargs`). The Trainer must use
    that optimizer, the loss must be finite and 4 losses logged. Returns the run.
    """
    import transformers

    model = tiny_llama().train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    extra: dict[str, Any] = {}
    if how == "optimizers":
        extra["optimizers"] = (optimizer(model.parameters(), **kwargs), None)
    else:
        extra["optimizer_cls_and_kwargs"] = (optimizer, kwargs)
    args = transformers.TrainingArguments(
        output_dir=os.fspath(tmp_path),
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=1,
        disable_tqdm=True,
        **(args_overrides or {}),
    )
    dataset = token_dataset(model.config.vocab_size, rows=8)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, **extra)
    result = trainer.train()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(opt, optimizer), type(opt)
    assert torch.isfinite(torch.tensor(result.training_loss))
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4
    return TrainerRun(trainer=trainer, model=model, optimizer=opt)


def check_trainer_resume_is_exact(
    make_optimizers: MakeOptimizers,
    tmp_path: os.PathLike[str] | str,
    *,
    steps: int = 6,
    stop_at: int = 3,
    dtype: torch.dtype = torch.float32,
    args_overrides: dict[str, Any] | None = None,
) -> tuple[TrainerRun, TrainerRun]:
    """Train `steps` steps straight; train again, saving and stopping at `stop_at`, then resume.

    The resumed run starts from a model with other initial weights, so that only the checkpoint
    can make it right. Its final parameters, every optimizer state entry (bit for bit) and its
    logged learning rates must equal the uninterrupted run's.

    Returns the uninterrupted and the resumed run.
    """
    root = os.fspath(tmp_path)
    kw: dict[str, Any] = {"steps": steps, "dtype": dtype, "args_overrides": args_overrides}
    straight = _train(make_optimizers, os.path.join(root, "straight"), model_seed=0, **kw)
    stopped_dir = os.path.join(root, "stopped")
    stopped = _train(
        make_optimizers, stopped_dir, model_seed=0, save_steps=stop_at, stop_at=stop_at, **kw
    )
    assert stopped.trainer.state.global_step == stop_at, stopped.trainer.state.global_step
    checkpoint = os.path.join(stopped_dir, f"checkpoint-{stop_at}")
    assert os.path.isfile(os.path.join(checkpoint, "optimizer.pt")), os.listdir(checkpoint)
    resumed = _train(make_optimizers, stopped_dir, model_seed=1, resume_from=checkpoint, **kw)
    assert resumed.trainer.state.global_step == steps

    named_a = dict(straight.model.named_parameters())
    named_b = dict(resumed.model.named_parameters())
    assert named_a.keys() == named_b.keys()
    for name, a in named_a.items():
        b = named_b[name]
        assert a.dtype == b.dtype == dtype, (name, a.dtype, b.dtype)
        assert torch.equal(a, b), f"{name}: max diff {(a.double() - b.double()).abs().max()}"
        sa, sb = straight.optimizer.state[a], resumed.optimizer.state[b]
        assert sa.keys() == sb.keys(), (name, sorted(sa), sorted(sb))
        assert sa, f"{name}: no optimizer state"
        for key, value in sa.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == sb[key].dtype, (name, key, value.dtype, sb[key].dtype)
                assert torch.equal(value, sb[key]), f"{name} {key} differs after the resume"
            else:
                assert value == sb[key], (name, key, value, sb[key])

    def lrs(run: TrainerRun) -> dict[int, float]:
        return {h["step"]: h["learning_rate"] for h in run.trainer.state.log_history if "loss" in h}

    lr_a, lr_b = lrs(straight), lrs(resumed)
    assert len(lr_a) == steps
    assert {s: lr for s, lr in lr_a.items() if s > stop_at} == {
        s: lr for s, lr in lr_b.items() if s > stop_at
    }
    return straight, resumed
