"""The training loop shared by the stages that train (`pretrain`, `distill`).

A step consumes a global batch of `micro_batch_size x grad_accum_steps x processes` sequences
(`data.global_batch_indices(step)`, or the stream's next windows); process r takes the r-th
slice. Every micro-batch has the same number of tokens, so the mean of micro-batch losses is the
global batch's loss: one process with `grad_accum_steps = k` and k processes with 1 optimise the
same objective, whichever engine (`train.engines`) runs. A step with a non-finite loss or
gradient norm is skipped; past `max_bad_steps` the run checkpoints and raises.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from leanlm.config import ConfigError, TrainConfig
from leanlm.report.metrics import MetricsLog
from leanlm.run import interrupt
from leanlm.stages.base import StageContext
from leanlm.train.checkpoint import Checkpointer, save_model_folder
from leanlm.train.engines import Parallel
from leanlm.train.evaluate import EvalResult, causal_lm_loss, evaluate_perplexity
from leanlm.train.model import count_parameters
from leanlm.train.progress import Progress

__all__ = [
    "LossFn",
    "SaveFn",
    "TrainingDivergedError",
    "causal_lm_loss",
    "save_pretrained",
    "train",
]

LossFn = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
"""`loss_fn(model, input_ids)`: the mean loss of a micro-batch `(B, T)` (a scalar tensor)."""

SaveFn = Callable[[torch.nn.Module, Path, dict[str, torch.Tensor] | None], None]
"""`save(model, folder, state_dict)`: write the trained model (`state_dict` is given when the
parameters live in shards and had to be gathered)."""


class TrainingDivergedError(RuntimeError):
    """The loss stayed NaN/inf for more steps than `max_bad_steps`; a checkpoint was written."""


def save_pretrained(
    model: torch.nn.Module, folder: Path, state_dict: dict[str, torch.Tensor] | None
) -> None:
    """The default `SaveFn`: `model.save_pretrained(folder)`."""
    model.save_pretrained(folder, state_dict=state_dict)  # type: ignore[operator]


def skip_scaled_step(scaler: torch.amp.GradScaler | None) -> None:
    """Tell fp16's loss scaler (accelerate's, `None` otherwise) that this step was skipped.

    Its scale drops as after an overflow, and its per-step record is cleared: `clip` has
    unscaled the gradients, and a second `unscale_` before `update` raises.
    """
    if scaler is not None:
        scaler.update(scaler.get_scale() * scaler.get_backoff_factor())


@dataclass
class _Counters:
    """What a training checkpoint carries besides model, optimizer and scheduler."""

    step: int = 0
    """Optimizer steps done."""
    tokens: int = 0
    train_time: float = 0.0
    """Seconds spent in training steps (no evaluation, no checkpoints)."""
    wall_before: float = 0.0
    """Wall time of the stage before this process resumed it."""
    bad_steps: int = 0


class _Loop:
    """One training stage's loop; `train` drives it (resume, steps, log/eval, finish)."""

    def __init__(
        self,
        ctx: StageContext,
        model: torch.nn.Module,
        cfg: TrainConfig,
        loss_fn: LossFn,
        save: SaveFn,
    ) -> None:
        self.ctx, self.cfg, self.loss_fn, self.save = ctx, cfg, loss_fn, save
        self.name = ctx.stage_dir.name
        self.acc = acc = ctx.accelerator
        # the global batches: shuffled in-memory blocks, or a stream (`[data] streaming`)
        self.batches = ctx.resources.train_batches()
        available = self.batches.num_sequences
        self.world, self.rank = acc.num_processes, acc.process_index
        self.per_rank = cfg.micro_batch_size * cfg.grad_accum_steps
        self.global_batch = self.per_rank * self.world
        if available is not None and self.global_batch > available:
            raise ConfigError(
                f"{self.name}.micro_batch_size",
                f"x `grad_accum_steps` x processes = {cfg.micro_batch_size} x "
                f"{cfg.grad_accum_steps} x {self.world} = {self.global_batch} sequences per "
                f"step, more than the training set holds ({available}); lower "
                "them or use more data",
            )
        self.tokens_per_step = self.global_batch * ctx.config.data.seq_len
        self.n_params = count_parameters(model)
        if ctx.config.data.packing:  # per-document positions and labels (`leanlm.data.packing`)
            from leanlm.data import packing

            packing.install(model, ctx.resources.tokenizer.eos_token_id)
        self.par = Parallel(ctx, model, cfg)
        self.model, self.optimizer = self.par.model, self.par.optimizer
        # The scheduler is stepped by us once per optimizer step and not passed to `prepare`:
        # accelerate would step it once per process, changing the schedule with the world size.
        self.scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            self.optimizer, cfg.warmup_steps, cfg.steps, min_lr_rate=cfg.min_lr_ratio
        )
        self.model.train()
        folder = ctx.stage_dir / "checkpoints"
        self.checkpoints = Checkpointer(folder, acc, keep=cfg.keep_checkpoints)
        self.counters = _Counters()
        self.step_lr = 0.0
        """The learning rate the last step applied (the scheduler has moved on since)."""
        self.evaluation: EvalResult | None = None
        self.wall_start = time.perf_counter()

    # -- resume -----------------------------------------------------------------------------

    def resume(self) -> None:
        """With `ctx.resume`: drop checkpoints of another config, load the newest of this one."""
        ctx, acc = self.ctx, self.acc
        if not ctx.resume:
            return
        latest = self.checkpoints.latest(config_hash=ctx.config_hash)
        stale = self.checkpoints.discard_mismatched(ctx.config_hash)
        if stale:
            acc.print(f"[{self.name}] config changed: dropped {stale} checkpoint(s), starting over")
        if latest is None:
            return
        state = self.checkpoints.load(
            latest, self.scheduler, sharded=self.par.sharded, whole=self.par.whole
        )
        self.counters = _Counters(
            step=state["step"],
            tokens=state["tokens"],
            train_time=state["train_time_s"],
            wall_before=state["wall_time_s"],
            bad_steps=state.get("bad_steps", 0),
        )
        self.batches.load_state(state.get("data", {}), self.counters.step)
        written = state.get("processes", self.world)
        moved = f", written on {written} process(es)" if written != self.world else ""
        acc.print(f"[{self.name}] resuming from {latest.name} (step {self.counters.step}{moved})")

    def checkpoint(self, done: int) -> Path:
        """Write a resumable checkpoint after `done` steps."""
        c = self.counters
        return self.checkpoints.save(
            done,
            self.scheduler,
            {
                "tokens": c.tokens,
                "train_time_s": c.train_time,
                "config_hash": self.ctx.config_hash,
                "wall_time_s": c.wall_before + time.perf_counter() - self.wall_start,
                "bad_steps": c.bad_steps,
                "processes": self.world,
                "data": self.batches.state(),
            },
            sharded=self.par.sharded,
            whole=self.par.whole,
        )

    # -- one optimizer step -----------------------------------------------------------------

    def step(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """Train on step `step`'s global batch; returns (loss, gradient norm, stop requested).

        A step whose loss or gradient norm is not finite on any process is skipped (counted in
        `bad_steps`); the schedule moves on either way.
        """
        cfg, acc, par = self.cfg, self.acc, self.par
        t0 = time.perf_counter()
        lo = self.rank * self.per_rank
        everyone = self.batches.global_batch(step, self.global_batch)
        mine = everyone[lo : lo + self.per_rank].to(acc.device)
        loss_sum = torch.zeros((), device=acc.device)
        for micro in range(cfg.grad_accum_steps):
            batch = mine[micro * cfg.micro_batch_size : (micro + 1) * cfg.micro_batch_size]
            last = micro == cfg.grad_accum_steps - 1
            # Gradients are reduced across processes only on the last micro-batch of the step.
            with contextlib.nullcontext() if last else par.no_sync():
                with par.forward_context():
                    loss = self.loss_fn(self.model, batch) / cfg.grad_accum_steps
                acc.backward(loss)
            loss_sum += loss.detach()
        grad_norm = par.clip(cfg.grad_clip) if cfg.grad_clip else None
        # One host sync per step (not per micro-batch): is the step usable on every process,
        # and was a stop requested on any (then all stop after this step)?
        finite = torch.isfinite(loss_sum) & (
            torch.isfinite(grad_norm) if grad_norm is not None else torch.tensor(True)
        )
        stop_here = torch.tensor(float(interrupt.requested()), device=acc.device)
        flags = torch.stack([finite.to(acc.device, torch.float32), stop_here])
        agreed = acc.reduce(flags, reduction="sum").tolist()
        usable, stop = agreed[0] == self.world, agreed[1] > 0
        c = self.counters
        self.step_lr = self.scheduler.get_last_lr()[0]  # what this step applies; logged for it
        if usable:
            self.optimizer.step()
        else:
            c.bad_steps += 1
            acc.print(f"[{self.name}] step {step + 1}: non-finite loss or gradient, step skipped")
            skip_scaled_step(acc.scaler)
        self.scheduler.step()  # the schedule follows the step number, skipped or not
        self.optimizer.zero_grad(set_to_none=True)
        c.train_time += time.perf_counter() - t0
        c.tokens += self.tokens_per_step
        c.step = step + 1
        return loss_sum, grad_norm, stop

    def check_diverged(self, close: Callable[[], None]) -> None:
        """Past `max_bad_steps` skipped steps: checkpoint and raise `TrainingDivergedError`."""
        c, name, cfg = self.counters, self.name, self.cfg
        if c.bad_steps <= cfg.max_bad_steps:
            return
        path = self.checkpoint(c.step)
        close()
        raise TrainingDivergedError(
            f"[{name}] the loss or gradient was NaN/inf on {c.bad_steps} steps, more than "
            f"`{name}.max_bad_steps` ({cfg.max_bad_steps}); stopped at step {c.step} with a "
            f"checkpoint in {path}. Lower `{name}.lr`, raise `{name}.warmup_steps` or "
            f"enable `{name}.grad_clip`, then rerun with --resume --restart-changed "
            "(which restarts the changed stages)."
        )

    # -- log / evaluate ---------------------------------------------------------------------

    def evaluate(self) -> EvalResult:
        """Validation loss and perplexity of the current weights."""
        return evaluate_perplexity(
            self.acc.unwrap_model(self.model),
            self.ctx.resources.validation_windows,
            batch_size=self.cfg.eval_batch_size,
            autocast=self.acc.autocast,
            lockstep=self.par.lockstep,
        )

    def log_and_eval(
        self, log: MetricsLog, bar: Progress, loss_sum: torch.Tensor, grad_norm: Any
    ) -> float | None:
        """Log every `log_every` steps, evaluate every `eval_every` steps and at the last one.

        Returns the loss written to the log (None when this step is not logged).
        """
        cfg, c, done = self.cfg, self.counters, self.counters.step
        loss_value = None
        if done % cfg.log_every == 0 or done == cfg.steps:
            loss_value = self.acc.reduce(loss_sum, reduction="mean").item()
            row: dict[str, Any] = {
                "step": done,
                "loss": loss_value,
                "lr": self.step_lr,
                "tokens": c.tokens,
                "tokens_per_s": c.tokens / c.train_time,
                "time_s": c.train_time,
            }
            if grad_norm is not None:
                row["grad_norm"] = float(grad_norm)
            if c.bad_steps:
                row["bad_steps"] = c.bad_steps
            log.log(row)
        if done % cfg.eval_every == 0 or done == cfg.steps:
            self.evaluation = evaluation = self.evaluate()
            log.log(
                {"step": done, "val_loss": evaluation.loss, "val_perplexity": evaluation.perplexity}
            )
            bar.write(
                f"[{self.name}] step {done}: validation loss {evaluation.loss:.4f}, "
                f"perplexity {evaluation.perplexity:.2f}"
            )
        return loss_value

    # -- the loop and the end ---------------------------------------------------------------

    def run(self) -> None:
        """Train from the resumed step to `cfg.steps`.

        Logs, evaluates and checkpoints on schedule, and stops at a step boundary on a signal.
        """
        cfg, acc, name = self.cfg, self.acc, self.name
        start = self.counters.step
        log = MetricsLog(
            self.ctx.stage_dir / "metrics.jsonl",
            enabled=acc.is_main_process,
            resume_step=start,
            sinks=self.ctx.sinks,
        )
        parallel = self.par.label
        available = self.batches.num_sequences
        sequences = f"{available:,}" if available is not None else "streamed"
        procs = f"{self.world} process(es)" + (f" {parallel}" if parallel else "")
        acc.print(
            f"[{name}] {self.n_params:,} params, {sequences} train sequences "
            f"of {self.ctx.config.data.seq_len} tokens, global batch {self.global_batch} "
            f"({self.tokens_per_step:,} tokens) on {procs}, {cfg.steps} steps, {cfg.optimizer}"
        )
        bar = Progress(name, total=cfg.steps, initial=start, enabled=acc.is_local_main_process)

        def close() -> None:
            bar.close()
            log.close()

        self.wall_start = time.perf_counter()
        with interrupt.at_step_boundaries(), contextlib.closing(bar):  # closed on errors too
            for step in range(start, cfg.steps):
                loss_sum, grad_norm, stop = self.step(step)
                self.check_diverged(close)
                done = self.counters.step
                loss_value = self.log_and_eval(log, bar, loss_sum, grad_norm)
                due = cfg.checkpoint_every and done % cfg.checkpoint_every == 0
                if due and done < cfg.steps:
                    self.checkpoint(done)
                c = self.counters
                bar.update(
                    done,
                    loss=loss_value,
                    tokens_per_s=c.tokens / c.train_time if loss_value is not None else None,
                )
                interrupt.progress(name, done)
                if stop:  # a signal: keep this step's work if checkpoints are on, then end the run
                    if cfg.checkpoint_every and not (due and done < cfg.steps):
                        self.checkpoint(done)
                    close()
                    raise interrupt.stopped(name, done)
        close()

    def finish(self) -> dict[str, Any]:
        """Score the final weights if not yet done, save the model folder, return the metrics."""
        acc, c, ctx = self.acc, self.counters, self.ctx
        evaluation = self.evaluation
        if evaluation is None:  # resumed after the last step: score the final weights
            evaluation = self.evaluate()
        model_state = self.par.model_state_mib()
        host_state = self.par.host_state_mib()
        full_state = self.par.final_state()
        acc.wait_for_everyone()
        final = acc.unwrap_model(self.model)
        save_model_folder(ctx, lambda folder: self.save(final, folder, full_state))
        acc.free_memory()  # drop references so a later stage's save_state sees only its objects
        metrics: dict[str, Any] = {
            "params": self.n_params,
            "tokens": c.tokens,
            "wall_time_s": c.wall_before + time.perf_counter() - self.wall_start,
            "train_time_s": c.train_time,
            "tokens_per_s": c.tokens / c.train_time if c.train_time else 0.0,
            "val_loss": evaluation.loss,
            "val_perplexity": evaluation.perplexity,
            "eval_tokens": evaluation.tokens,
            "eval_tokens_per_s": evaluation.tokens_per_s,
            "processes": self.world,
            "optimizer": self.cfg.optimizer,
            "parallel": self.par.label or "none",
            "bad_steps": c.bad_steps,
        }
        if model_state is not None:
            metrics["model_state_mib"] = model_state
        if host_state is not None:
            metrics["model_state_host_mib"] = host_state
        return metrics


def train(
    ctx: StageContext,
    model: torch.nn.Module,
    cfg: TrainConfig,
    loss_fn: LossFn,
    *,
    save: SaveFn = save_pretrained,
) -> dict[str, Any]:
    """Train `model` (fp32, unwrapped) on the run's training blocks and save it as the stage output.

    Checkpoints every `cfg.checkpoint_every` steps, resumes from the newest checkpoint of the same
    configuration when `ctx.resume`, evaluates validation perplexity every `cfg.eval_every` steps
    and at the end, logs `metrics.jsonl` + TensorBoard, and writes `ctx.model_dir` (model via
    `save`, and the tokenizer). Returns the stage's report metrics.

    Raises:
        TrainingDivergedError: more than `cfg.max_bad_steps` steps had a non-finite loss.
    """
    loop = _Loop(ctx, model, cfg, loss_fn, save)
    loop.resume()
    loop.run()
    return loop.finish()
