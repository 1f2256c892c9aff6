"""`leanlm plan` against a real run: a tiny prune -> distill -> sparsify on CPU, measured with
the plan's own accounting (torch's `MemTracker` on the real tensors), is within 10% of its plan.

The stage code runs unchanged; the test wraps the library calls the plan runs on fake tensors
(importance scoring, one-shot pruning, validation passes) and the trainer's second step and
measures each with `leanlm.plan_tracking.measure`, tracking what the stage holds at that moment.
"""

import dataclasses

import leanlm.train.distill as distill_train
import leanlm.train.evaluate as evaluate_module
import prune_distill
import sparse_kernels
from leanlm.config import SparsifyConfig
from leanlm.plan import plan
from leanlm.plan_tracking import measure as plan_measure
from leanlm.run.pipeline import run_pipeline
from leanlm.train.trainer import _Loop

STEP = ("forward", "backward", "optimizer")


def _peak(phases, names=None):
    return max(parts["total"] for name, parts in phases.items() if names is None or name in names)


def _measure_the_run(config, out, monkeypatch):
    """Run `config`; the measured peak of each planned pass, by name."""
    measured: dict[str, int] = {}
    held = {}  # what the stage holds besides the model a pass runs on

    def measure(name, fn, *tracked):
        result = []

        def step(tracker):
            tracker.phase = name
            result.append(fn())

        measured[name] = _peak(plan_measure(step, list(tracked)))
        return result[0]

    originals = (
        prune_distill.collect_importance,
        sparse_kernels.sparsify_,
        evaluate_module.evaluate_perplexity,
        _Loop.step,
        _Loop.evaluate,
        distill_train.distillation_loss,
    )
    scoring, one_shot, validate, loop_step, loop_evaluate, distillation_loss = originals

    def collect_importance(model, *args, **kwargs):
        held["prune"] = model  # still held while the pruned model is scored
        return measure("prune scoring", lambda: scoring(model, *args, **kwargs), model)

    def sparsify_(model, *args, **kwargs):
        held.pop("prune", None)
        return measure("sparsify scoring", lambda: one_shot(model, *args, **kwargs), model)

    def evaluate_perplexity(model, *args, **kwargs):  # the prune and sparsify stages' own
        run = lambda: validate(model, *args, **kwargs)  # noqa: E731
        if "prune" in held:
            return measure("prune evaluate", run, held["prune"], model)
        return measure("sparsify one-shot evaluate", run, model)

    def tracked(loop):
        return [loop.model, loop.optimizer, *held.get(loop.name, [])]

    def step(self, index):
        if index != 1:  # the second step: the optimizer state exists, as in the plan
            return loop_step(self, index)
        return measure(f"{self.name} step", lambda: loop_step(self, index), *tracked(self))

    def evaluate(self):
        return measure(f"{self.name} evaluate", lambda: loop_evaluate(self), *tracked(self))

    def teacher_loss(teacher, cfg):
        held["distill"] = [teacher]
        return distillation_loss(teacher, cfg)

    monkeypatch.setattr(prune_distill, "collect_importance", collect_importance)
    monkeypatch.setattr(sparse_kernels, "sparsify_", sparsify_)
    monkeypatch.setattr(evaluate_module, "evaluate_perplexity", evaluate_perplexity)
    monkeypatch.setattr(_Loop, "step", step)
    monkeypatch.setattr(_Loop, "evaluate", evaluate)
    monkeypatch.setattr(distill_train, "distillation_loss", teacher_loss)
    run_pipeline(config, out)
    monkeypatch.undo()  # (the plan calls the same functions)
    return measured


def test_a_tiny_real_run_peaks_within_10_percent_of_its_plan(
    prune_distill_config, tmp_path, monkeypatch
):
    config = prune_distill_config(teacher="online", micro_batch_size=4, grad_accum_steps=2)
    sparsify = SparsifyConfig(
        method="sparsegpt",  # (its solver is planned by a stand-in: checked here)
        calibration_samples=8,
        calibration_batch_size=4,
        steps=2,
        micro_batch_size=4,
        warmup_steps=1,
        eval_every=2,
        eval_batch_size=4,
        checkpoint_every=0,
    )
    config = dataclasses.replace(config, stages=(*config.stages, "sparsify"), sparsify=sparsify)
    measured = _measure_the_run(config, tmp_path / "run", monkeypatch)

    plans = {name: stage.phases for name, stage in plan(config).items()}
    planned = {
        "prune scoring": plans["prune"]["scoring"]["total"],
        "prune evaluate": plans["prune"]["evaluate"]["total"],
        "distill step": _peak(plans["distill"], STEP),
        "distill evaluate": plans["distill"]["evaluate"]["total"],
        "sparsify scoring": plans["sparsify"]["scoring"]["total"],
        "sparsify one-shot evaluate": plans["sparsify"]["one_shot_evaluate"]["total"],
        "sparsify step": _peak(plans["sparsify"], STEP),
        "sparsify evaluate": plans["sparsify"]["evaluate"]["total"],
    }
    assert set(measured) == set(planned)
    for name, bytes_ in planned.items():
        assert abs(measured[name] - bytes_) <= 0.1 * bytes_, (name, measured[name], bytes_)
