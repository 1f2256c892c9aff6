"""The training loop shared by the stages that train (`pretrain`, `distill`).

One optimizer step consumes a global batch of `micro_batch_size x grad_accum_steps x processes`
sequences chosen by `data.global_batch_indices(step)`; process r takes the r-th contiguous slice.
Every micro-batch has the same number of tokens (fixed-length blocks, no padding), so the mean of
micro-batch losses, averaged over processes by DDP, is exactly the loss of the global batch: one
process with `grad_accum_steps = k` and k processes with 1 optimise the same objective.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from leanlm.checkpoint import Checkpointer, save_atomically
from leanlm.config import TrainConfig
from leanlm.data import global_batch_indices
from leanlm.evaluate import EvalResult, evaluate_perplexity
from leanlm.metrics import MetricsLog, peak_memory_mib
from leanlm.model import count_parameters
from leanlm.optim import build_optimizer
from leanlm.stages import StageContext

LossFn = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
"""`loss_fn(model, input_ids)`: the mean loss of a micro-batch `(B, T)` (a scalar tensor)."""


def causal_lm_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over the batch's predicted tokens."""
    loss: torch.Tensor = model(input_ids=input_ids, labels=input_ids).loss
    return loss


def train(
    ctx: StageContext, model: torch.nn.Module, cfg: TrainConfig, loss_fn: LossFn
) -> dict[str, Any]:
    """Train `model` (fp32, unwrapped) on the run's training blocks and save it as the stage output.

    Checkpoints every `cfg.checkpoint_every` steps, resumes from the newest checkpoint of the same
    configuration when `ctx.resume`, evaluates validation perplexity every `cfg.eval_every` steps
    and at the end, logs `metrics.jsonl` + TensorBoard, and writes `ctx.model_dir` (model and
    tokenizer). Returns the stage's report metrics.
    """
    name = ctx.stage_dir.name
    acc = ctx.accelerator
    res = ctx.resources
    tokenizer = res.tokenizer
    train_blocks, val_windows = res.train_blocks, res.validation_windows

    n_params = count_parameters(model)
    optimizer = build_optimizer(
        cfg.optimizer, model, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas
    )
    # The scheduler is stepped by us once per optimizer step and not passed to `prepare`:
    # accelerate would step it once per process, changing the schedule with the world size.
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, cfg.warmup_steps, cfg.steps, min_lr_rate=cfg.min_lr_ratio
    )
    model, optimizer = acc.prepare(model, optimizer)
    model.train()

    world, rank = acc.num_processes, acc.process_index
    per_rank = cfg.micro_batch_size * cfg.grad_accum_steps
    global_batch = per_rank * world
    seq_len = ctx.config.data.seq_len
    tokens_per_step = global_batch * seq_len

    checkpoints = Checkpointer(ctx.stage_dir / "checkpoints", acc, keep=cfg.keep_checkpoints)
    start_step, tokens, train_time, wall_before = 0, 0, 0.0, 0.0
    latest = checkpoints.latest(config_hash=ctx.config_hash) if ctx.resume else None
    stale = checkpoints.discard_mismatched(ctx.config_hash) if ctx.resume else 0
    if stale:
        acc.print(f"[{name}] config changed: dropped {stale} checkpoint(s), starting over")
    if latest is not None:
        state = checkpoints.load(latest, scheduler)
        start_step, tokens = state["step"], state["tokens"]
        train_time, wall_before = state["train_time_s"], state["wall_time_s"]
        acc.print(f"[{name}] resuming from {latest.name} (step {start_step})")

    log = MetricsLog(
        ctx.stage_dir / "metrics.jsonl", enabled=acc.is_main_process, resume_step=start_step
    )
    acc.print(
        f"[{name}] {n_params:,} params, {train_blocks.shape[0]:,} train sequences of "
        f"{seq_len} tokens, global batch {global_batch} ({tokens_per_step:,} tokens) on "
        f"{world} process(es), {cfg.steps} steps, {cfg.optimizer}"
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
            # Gradients are all-reduced only on the last micro-batch of the step.
            with contextlib.nullcontext() if last else acc.no_sync(model):
                loss = loss_fn(model, batch) / cfg.grad_accum_steps
                acc.backward(loss)
            loss_sum += loss.detach()
        grad_norm = (
            acc.clip_grad_norm_(model.parameters(), cfg.grad_clip) if cfg.grad_clip else None
        )
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        train_time += time.perf_counter() - t0
        tokens += tokens_per_step
        done = step + 1

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
            log.log(row)
            bar.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
        if done % cfg.eval_every == 0 or done == cfg.steps:
            evaluation = evaluate()
            log.log(
                {"step": done, "val_loss": evaluation.loss, "val_perplexity": evaluation.perplexity}
            )
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.steps:
            checkpoints.save(
                done,
                scheduler,
                {
                    "tokens": tokens,
                    "train_time_s": train_time,
                    "config_hash": ctx.config_hash,
                    "wall_time_s": wall_before + time.perf_counter() - wall_start,
                },
            )
        bar.update(1)
    bar.close()
    log.close()

    if evaluation is None:  # resumed after the last step: score the final weights
        evaluation = evaluate()
    acc.wait_for_everyone()
    if acc.is_main_process:
        final = acc.unwrap_model(model)

        def write(folder: Any) -> None:
            final.save_pretrained(folder)
            tokenizer.save_pretrained(folder)

        save_atomically(ctx.model_dir, write)
    acc.wait_for_everyone()
    peak = peak_memory_mib(acc.device)
    acc.free_memory()  # drop references so a later stage's save_state sees only its objects
    return {
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
    }
