"""Run the stages of a `RunConfig` in order, resumably, and write the report."""

from __future__ import annotations

import dataclasses
import datetime
import shutil
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list

from leanlm.config import INIT_STAGE, ConfigError, RunConfig, dumps_toml, to_dict
from leanlm.data.resources import RunResources
from leanlm.report.downstream import Downstream
from leanlm.report.markdown import write_report
from leanlm.report.metrics import WandbRun, peak_memory_mib, require_wandb, reset_peak_memory
from leanlm.run import interrupt
from leanlm.run.datafiles import data_fingerprint, scan_data, write_record
from leanlm.run.rundir import CONFIG_FILE, check_reuse, holds_work, mark_run_dir, stage_hash
from leanlm.stages import STAGES, StageContext, StageResult
from leanlm.train.model import weights_stats


def make_accelerator(config: RunConfig) -> Accelerator:
    """An `Accelerator` for this machine.

    Without CUDA it passes `cpu=True` itself: under `torchrun --nproc_per_node N` or
    `accelerate launch --multi_gpu --num_processes N` that is what makes accelerate join the N
    processes into one gloo group instead of running N independent single-process jobs. The
    group's collectives time out after `config.collective_timeout_s` (FSDP2's mesh and
    shard-zero use this group).

    Raises:
        ConfigError: `mixed_precision = "fp16"` without CUDA (accelerate would train in fp32).
    """
    cpu = not torch.cuda.is_available()
    if cpu and config.mixed_precision == "fp16":
        raise ConfigError(
            "mixed_precision",
            "('fp16') needs a CUDA GPU, and this machine has none: on the CPU accelerate "
            'would silently train in fp32; use "bf16" (CPU autocast) or "no"',
        )
    timeout = datetime.timedelta(seconds=config.collective_timeout_s)
    return Accelerator(
        cpu=cpu,
        mixed_precision=config.mixed_precision,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)],
    )


def run_pipeline(
    config: RunConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    restart_changed: bool = False,
    command: str | None = None,
) -> list[StageResult]:
    """Run `config.stages` in order into `out_dir`; returns each stage's result.

    Every stage writes `out_dir/<stage>/` (its model folder, metrics, checkpoints, result). With
    `resume`, a stage whose stored result has the same hash is skipped and an unfinished one
    continues from its latest checkpoint. `out_dir` must be new, empty or a leanlm run folder
    (`leanlm.run.rundir.RUN_MARKER`); without `resume` it must not hold a run (a result or a
    checkpoint; what a run that failed before its first checkpoint left is replaced). With
    `resume`, a config change that would discard a stored result or checkpoint (see
    `leanlm.run.rundir.check_reuse`) stops the run unless `restart_changed`: then the stages
    whose inputs changed, and all after them, start over. `command` is how the run was started
    (shown in the report). With `[eval]` tasks each stage's model is then scored by
    lm-evaluation-harness (`leanlm.report.downstream`; a stored result only on the tasks it lacks);
    with `[logging] wandb` the main process logs the training scalars to one W&B run.

    A change of a data file's content (`leanlm.run.datafiles`) changes every stage's hash, like
    a config change; a validation split shorter than one window is a `ConfigError` before the
    first stage.

    Raises:
        leanlm.configio.ConfigError: `[eval]` or `[logging]` needs a package that is not
            installed, or names an unknown task, or `mixed_precision = "fp16"` on a machine
            without CUDA (before any work).
        FileExistsError: if `out_dir` holds a run and `resume` is false, or files that are not
            a leanlm run's.
        leanlm.run.rundir.ConfigChangedError: `resume` with a changed config (the keys are listed)
            and not `restart_changed`.
        leanlm.run.interrupt.Interrupted: the run was stopped by SIGTERM / SIGINT.
    """
    out_dir = Path(out_dir)
    require_wandb(config.logging)
    accelerator = make_accelerator(config)
    downstream = Downstream(config, accelerator)  # checks `[eval]`'s tasks before any work
    processes = accelerator.num_processes
    # the content of the data files (a hub dataset's revision), read once by the main process
    # (a file unchanged since the run's `data-files.json` keeps its digest unread): part of the
    # stage hashes
    mine, stats = scan_data(config, out_dir) if accelerator.is_main_process else ({}, {})
    data = broadcast_object_list([mine])[0]
    check_reuse(
        out_dir,
        config,
        resume=resume,
        restart_changed=restart_changed,
        processes=processes,
        data=data,
    )
    fresh = not holds_work(out_dir)
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        mark_run_dir(out_dir)  # first: a worker checking `out_dir` after this sees a run folder
        for name in config.stages if fresh else ():  # logs of a start that failed early
            shutil.rmtree(out_dir / name, ignore_errors=True)
        (out_dir / CONFIG_FILE).write_text(dumps_toml(config))
        write_record(out_dir, data, stats)
    accelerator.wait_for_everyone()
    resources = RunResources(config, accelerator)
    wandb_run = None
    if config.logging.wandb and accelerator.is_main_process:
        wandb_run = WandbRun(
            config.logging, out_dir, name=config.name, config=to_dict(config), resume=resume
        )
    accelerator.print(f"[leanlm] corpus: {resources.corpus.description}")
    resources.validation_windows  # noqa: B018  (built now: a split too short stops the run here)

    results: list[StageResult] = []
    outputs: dict[str, Path] = {}
    previous_dir: Path | None = None
    previous_hash, data_hash = "", data_fingerprint(data)
    if config.init_model:  # a local folder or a hub id; from_pretrained takes either
        previous_dir = outputs[INIT_STAGE] = Path(config.init_model)
    start = time.perf_counter()
    for name in config.stages:
        interrupt.progress(name, 0)
        if interrupt.requested():
            raise interrupt.stopped(name, 0)
        stage_dir = out_dir / name
        digest = stage_hash(config, name, previous_hash, processes, data_hash)
        stored = StageResult.load(stage_dir) if resume else None
        if stored is not None and stored.config_hash == digest:
            accelerator.print(f"[leanlm] {name}: finished earlier with the same config, skipped")
            result = stored
        else:
            ctx = StageContext(
                config=config,
                run_dir=out_dir,
                stage_dir=stage_dir,
                input_dir=previous_dir,
                outputs=dict(outputs),
                accelerator=accelerator,
                resources=resources,
                resume=resume,
                config_hash=digest,
                sinks=(wandb_run.stage(name),) if wandb_run else (),
            )
            reset_peak_memory(accelerator.device)  # each stage's peak is its own
            result = STAGES[name]().run(ctx)
            measured = {
                **weights_stats(out_dir / result.model_dir),
                **result.metrics,
                "peak_rss_mib": peak_memory_mib(accelerator.device),
            }
            result = dataclasses.replace(result, metrics=measured)
            if accelerator.is_main_process:
                result.save(stage_dir)
            accelerator.wait_for_everyone()
        result = downstream.score(result, out_dir)  # `[eval]` tasks not yet in its result
        results.append(result)
        previous_dir, previous_hash = out_dir / result.model_dir, digest
        outputs[name] = previous_dir
    if accelerator.is_main_process:
        report = write_report(
            out_dir,
            config,
            results,
            corpus=resources.corpus.description,
            eval_windows=len(resources.validation_windows),
            command=command,
        )
        accelerator.print(f"[leanlm] done in {time.perf_counter() - start:.0f} s; report: {report}")
    if wandb_run is not None:
        wandb_run.close()
    accelerator.wait_for_everyone()
    return results
