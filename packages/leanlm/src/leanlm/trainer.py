"""The training loop shared by the stages that train (`pretrain`, `distill`).

One optimizer step consumes a global batch of `micro_batch_size x grad_accum_steps x processes`
sequences chosen by `data.global_batch_indices(step)`; process r takes the r-th contiguous slice.
Every micro-batch has the same number of tokens (fixed-length blocks, no padding), so the mean of
micro-batch losses, averaged over processes by DDP, is exactly the loss of the global batch: one
process with `grad_accum_steps = k` and k processes with 1 optimise the same objective.

Data parallelism is accelerate's DDP by default; with `zero_stage` 1-3 and several processes the
model and optimizer are sharded by shard-zero instead (row-sharded fp32 masters, exact for CAME
and Adafactor), with the same batches and the same loop. A step whose loss (or gradient norm) is
not finite on any process is skipped and counted; past `max_bad_steps` skips the run writes a
checkpoint and stops with `TrainingDivergedError`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from leanlm.checkpoint import Checkpointer, save_atomically
from leanlm.config import TrainConfig
from leanlm.data import global_batch_indices
from leanlm.evaluate import EvalResult, evaluate_perplexity
from leanlm.metrics import MetricsLog, peak_memory_mib, reset_peak_memory
from leanlm.model import count_parameters
from leanlm.optim import decay_param_groups, optimizer_over
from leanlm.stages import StageContext

LossFn = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
"""`loss_fn(model, input_ids)`: the mean loss of a micro-batch `(B, T)` (a scalar tensor)."""

SaveFn = Callable[[torch.nn.Module, Path, dict[str, torch.Tensor] | None], None]
"""`save(model, folder, state_dict)`: write the trained model (`state_dict` is given when the
parameters live in shards and had to be gathered)."""


class TrainingDivergedError(RuntimeError):
    """The loss stayed NaN/inf for more steps than `max_bad_steps`; a checkpoint was written."""


def causal_lm_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over the batch's predicted tokens."""
    loss: torch.Tensor = model(input_ids=input_ids, labels=input_ids).loss
    return loss


def save_pretrained(
    model: torch.nn.Module, folder: Path, state_dict: dict[str, torch.Tensor] | None
) -> None:
    """The default `SaveFn`: `model.save_pretrained(folder)`."""
    model.save_pretrained(folder, state_dict=state_dict)  # type: ignore[operator]


class _Parallel:
    """What differs between accelerate's DDP and shard-zero in the loop."""

    def __init__(self, ctx: StageContext, model: torch.nn.Module, cfg: TrainConfig) -> None:
        acc = ctx.accelerator
        self.acc = acc
        self.zero_stage = cfg.zero_stage if acc.num_processes > 1 else 0
        if cfg.zero_stage and not self.zero_stage:
            acc.print(f"[{ctx.stage_dir.name}] zero_stage={cfg.zero_stage} ignored: 1 process")

        def make_optimizer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
            groups = decay_param_groups(params, cfg.weight_decay)
            return optimizer_over(cfg.optimizer, groups, lr=cfg.lr, betas=cfg.betas)

        if self.zero_stage:
            from shard_zero import ZeroConfig, prepare

            if acc.device.type != "cpu":
                raise ValueError(
                    f"config key `{ctx.stage_dir.name}.zero_stage` ({cfg.zero_stage}): "
                    "shard-zero runs on CPU/gloo only for now; use zero_stage = 0 (DDP) on GPUs"
                )
            self.model, self.optimizer = prepare(
                model, make_optimizer, ZeroConfig(stage=self.zero_stage)
            )
        else:
            self.model, self.optimizer = acc.prepare(model, make_optimizer(model.parameters()))

    def no_sync(self) -> Any:
        if self.zero_stage:
            return self.model.no_sync()  # type: ignore[operator]
        return self.acc.no_sync(self.model)

    def clip(self, max_norm: float) -> torch.Tensor:
        if self.zero_stage:
            norm: torch.Tensor = self.optimizer.clip_grad_norm_(max_norm)
            return norm
        return self.acc.clip_grad_norm_(self.model.parameters(), max_norm)  # type: ignore[no-any-return]

    def forward_context(self) -> Any:
        # accelerate wraps a prepared model's forward in autocast; a sharded one is not prepared.
        return self.acc.autocast() if self.zero_stage else contextlib.nullcontext()

    @property
    def zero(self) -> tuple[torch.nn.Module, Any] | None:
        return (self.model, self.optimizer) if self.zero_stage else None

    def final_state(self) -> dict[str, torch.Tensor] | None:
        """The full fp32 state dict when sharded (a collective), else None."""
        if not self.zero_stage:
            return None
        from shard_zero import full_state_dict

        return full_state_dict(self.model)

    def model_state_mib(self) -> float | None:
        """Model-state bytes (params, masters, grads, optimizer state) of this rank, if sharded."""
        if not self.zero_stage:
            return None
        from shard_zero import memory_stats

        return float(memory_stats(self.model, self.optimizer)["total"]) / 2**20


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
    name = ctx.stage_dir.name
    acc = ctx.accelerator
    res = ctx.resources
    tokenizer = res.tokenizer
    train_blocks, val_windows = res.train_blocks, res.validation_windows
    reset_peak_memory(acc.device)

    n_params = count_parameters(model)
    par = _Parallel(ctx, model, cfg)
    model, optimizer = par.model, par.optimizer
    # The scheduler is stepped by us once per optimizer step and not passed to `prepare`:
    # accelerate would step it once per process, changing the schedule with the world size.
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, cfg.warmup_steps, cfg.steps, min_lr_rate=cfg.min_lr_ratio
    )
    model.train()

    world, rank = acc.num_processes, acc.process_index
    per_rank = cfg.micro_batch_size * cfg.grad_accum_steps
    global_batch = per_rank * world
    seq_len = ctx.config.data.seq_len
    tokens_per_step = global_batch * seq_len

    checkpoints = Checkpointer(ctx.stage_dir / "checkpoints", acc, keep=cfg.keep_checkpoints)
    start_step, tokens, train_time, wall_before, bad_steps = 0, 0, 0.0, 0.0, 0
    latest = checkpoints.latest(config_hash=ctx.config_hash) if ctx.resume else None
    stale = checkpoints.discard_mismatched(ctx.config_hash) if ctx.resume else 0
    if stale:
        acc.print(f"[{name}] config changed: dropped {stale} checkpoint(s), starting over")
    if latest is not None:
        state = checkpoints.load(latest, scheduler, zero=par.zero)
        start_step, tokens = state["step"], state["tokens"]
        train_time, wall_before = state["train_time_s"], state["wall_time_s"]
        bad_steps = state.get("bad_steps", 0)
        acc.print(f"[{name}] resuming from {latest.name} (step {start_step})")

    log = MetricsLog(
        ctx.stage_dir / "metrics.jsonl", enabled=acc.is_main_process, resume_step=start_step
    )
    parallel = f"ZeRO-{par.zero_stage}" if par.zero_stage else "DDP" if world > 1 else ""
    acc.print(
        f"[{name}] {n_params:,} params, {train_blocks.shape[0]:,} train sequences of "
        f"{seq_len} tokens, global batch {global_batch} ({tokens_per_step:,} tokens) on "
        f"{world} process(es) {parallel}, {cfg.steps} steps, {cfg.optimizer}"
    )
    bar = tqdm(
        total=cfg.steps,
        initial=start_step,
        desc=name,
        mininterval=2.0,
        disable=not acc.is_local_main_process,
    )

    def evaluate() -> EvalResult:
        return evaluate_perplexity(
            acc.unwrap_model(model),
            val_windows,
            batch_size=cfg.eval_batch_size,
            autocast=acc.autocast,
        )

    def checkpoint(done: int) -> Path:
        return checkpoints.save(
            done,
            scheduler,
            {
                "tokens": tokens,
                "train_time_s": train_time,
                "config_hash": ctx.config_hash,
                "wall_time_s": wall_before + time.perf_counter() - wall_start,
                "bad_steps": bad_steps,
            },
            zero=par.zero,
        )

    evaluation: EvalResult | None = None
    wall_start = time.perf_counter()
    for step in range(start_step, cfg.steps):
        t0 = time.perf_counter()
        indices = global_batch_indices(
            step, global_batch=global_batch, num_blocks=train_blocks.shape[0], seed=ctx.config.seed
        )
        mine = train_blocks[indices[rank * per_rank : (rank + 1) * per_rank]].to(acc.device)
        loss_sum = torch.zeros((), device=acc.device)
        for micro in range(cfg.grad_accum_steps):
            batch = mine[micro * cfg.micro_batch_size : (micro + 1) * cfg.micro_batch_size]
            last = micro == cfg.grad_accum_steps - 1
            # Gradients are reduced across processes only on the last micro-batch of the step.
            with contextlib.nullcontext() if last else par.no_sync():
                with par.forward_context():
                    loss = loss_fn(model, batch) / cfg.grad_accum_steps
                acc.backward(loss)
            loss_sum += loss.detach()
        grad_norm = par.clip(cfg.grad_clip) if cfg.grad_clip else None
        # One host sync per step (not per micro-batch): is the step usable on every process?
        finite = torch.isfinite(loss_sum) & (
            torch.isfinite(grad_norm) if grad_norm is not None else torch.tensor(True)
        )
        usable = bool(acc.reduce(finite.to(acc.device, torch.float32), reduction="sum") == world)
        if usable:
            optimizer.step()
        else:
            bad_steps += 1
            acc.print(f"[{name}] step {step + 1}: non-finite loss or gradient, step skipped")
        scheduler.step()  # the schedule follows the step number, skipped or not
        optimizer.zero_grad(set_to_none=True)
        train_time += time.perf_counter() - t0
        tokens += tokens_per_step
        done = step + 1
        if bad_steps > cfg.max_bad_steps:
            path = checkpoint(done)
            bar.close()
            log.close()
            raise TrainingDivergedError(
                f"[{name}] the loss or gradient was NaN/inf on {bad_steps} steps, more than "
                f"`{name}.max_bad_steps` ({cfg.max_bad_steps}); stopped at step {done} with a "
                f"checkpoint in {path}. Lower `{name}.lr`, raise `{name}.warmup_steps` or "
                f"enable `{name}.grad_clip`, then rerun with --resume (a changed config "
                "restarts the stage)."
            )

        if done % cfg.log_every == 0 or done == cfg.steps:
            loss_value = acc.reduce(loss_sum, reduction="mean").item()
            row: dict[str, Any] = {
                "step": done,
                "loss": loss_value,
                "lr": scheduler.get_last_lr()[0],
                "tokens": tokens,
                "tokens_per_s": tokens / train_time,
                "time_s": train_time,
            }
            if grad_norm is not None:
                row["grad_norm"] = float(grad_norm)
            if bad_steps:
                row["bad_steps"] = bad_steps
            log.log(row)
            bar.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
        if done % cfg.eval_every == 0 or done == cfg.steps:
            evaluation = evaluate()
            log.log(
                {"step": done, "val_loss": evaluation.loss, "val_perplexity": evaluation.perplexity}
            )
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.steps:
            checkpoint(done)
        bar.update(1)
    bar.close()
    log.close()

    if evaluation is None:  # resumed after the last step: score the final weights
        evaluation = evaluate()
    model_state = par.model_state_mib()
    full_state = par.final_state()
    acc.wait_for_everyone()
    if acc.is_main_process:
        final = acc.unwrap_model(model)

        def write(folder: Path) -> None:
            save(final, folder, full_state)
            tokenizer.save_pretrained(folder)

        save_atomically(ctx.model_dir, write)
    acc.wait_for_everyone()
    peak = peak_memory_mib(acc.device)
    acc.free_memory()  # drop references so a later stage's save_state sees only its objects
    metrics: dict[str, Any] = {
        "params": n_params,
        "tokens": tokens,
        "wall_time_s": wall_before + time.perf_counter() - wall_start,
        "train_time_s": train_time,
        "tokens_per_s": tokens / train_time if train_time else 0.0,
        "val_loss": evaluation.loss,
        "val_perplexity": evaluation.perplexity,
        "eval_tokens": evaluation.tokens,
        "eval_tokens_per_s": evaluation.tokens_per_s,
        "peak_rss_mib": peak,
        "processes": world,
        "optimizer": cfg.optimizer,
        "parallel": parallel or "none",
        "bad_steps": bad_steps,
    }
    if model_state is not None:
        metrics["model_state_mib"] = model_state
    return metrics
