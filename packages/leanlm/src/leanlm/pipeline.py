"""Run the stages of a `RunConfig` in order, resumably, and write the report."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from leanlm import distill as _distill  # noqa: F401  (each import registers a stage)
from leanlm import pretrain as _pretrain  # noqa: F401
from leanlm import prune as _prune  # noqa: F401
from leanlm import sparsify as _sparsify  # noqa: F401
from leanlm.config import INIT_STAGE, RunConfig, dumps_toml
from leanlm.model import weights_stats
from leanlm.report import write_report
from leanlm.stages import STAGES, RunResources, StageContext, StageResult

CONFIG_FILE = "config.toml"


def make_accelerator(config: RunConfig) -> Accelerator:
    """An `Accelerator` for this machine.

    Without CUDA it passes `cpu=True` itself: under `torchrun --nproc_per_node N` or
    `accelerate launch --multi_gpu --num_processes N` that is what makes accelerate join the N
    processes into one gloo group instead of running N independent single-process jobs.
    """
    return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=config.mixed_precision)


def stage_hash(config: RunConfig, stage: str, previous_hash: str) -> str:
    """Hash of what a stage's output depends on.

    That is data, tokenizer, model, seed, precision, the stage's own section, and the previous
    stage's hash (so changing an early stage invalidates every later one).
    """
    own = config.fingerprint(
        "seed", "mixed_precision", "init_model", "data", "tokenizer", "model", stage
    )
    return hashlib.sha256(f"{own}:{previous_hash}".encode()).hexdigest()[:16]


def run_pipeline(
    config: RunConfig, out_dir: str | Path, *, resume: bool = False
) -> list[StageResult]:
    """Run `config.stages` in order into `out_dir`; returns each stage's result.

    Every stage writes `out_dir/<stage>/` (its model folder, metrics, checkpoints, result). With
    `resume`, a stage whose stored result has the same hash is skipped and an unfinished one
    continues from its latest checkpoint. Without `resume`, `out_dir` must not hold a run.

    Raises:
        FileExistsError: if `out_dir` holds a run and `resume` is false.
    """
    out_dir = Path(out_dir)
    if (out_dir / CONFIG_FILE).exists() and not resume:
        raise FileExistsError(
            f"{out_dir} already holds a run; pass --resume to continue it or choose another --out"
        )
    accelerator = make_accelerator(config)
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / CONFIG_FILE).write_text(dumps_toml(config))
    accelerator.wait_for_everyone()
    resources = RunResources(config, accelerator)
    accelerator.print(f"[leanlm] corpus: {resources.corpus.description}")

    results: list[StageResult] = []
    outputs: dict[str, Path] = {}
    previous_dir: Path | None = None
    previous_hash = ""
    if config.init_model:  # a local folder or a hub id; from_pretrained takes either
        previous_dir = outputs[INIT_STAGE] = Path(config.init_model)
    start = time.perf_counter()
    for name in config.stages:
        stage_dir = out_dir / name
        digest = stage_hash(config, name, previous_hash)
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
            )
            result = STAGES[name]().run(ctx)
            stored_weights = weights_stats(out_dir / result.model_dir)
            result = dataclasses.replace(result, metrics={**stored_weights, **result.metrics})
            if accelerator.is_main_process:
                result.save(stage_dir)
            accelerator.wait_for_everyone()
        results.append(result)
        previous_dir, previous_hash = out_dir / result.model_dir, digest
        outputs[name] = previous_dir
    if accelerator.is_main_process:
        report = write_report(out_dir, config, results, corpus=resources.corpus.description)
        accelerator.print(f"[leanlm] done in {time.perf_counter() - start:.0f} s; report: {report}")
    accelerator.wait_for_everyone()
    return results
