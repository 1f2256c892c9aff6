"""The full pipeline on a tiny model: pretrain -> prune -> distill -> sparsify -> control."""

import dataclasses
import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from leanlm.config import (
    ConfigError,
    ControlConfig,
    DistillConfig,
    PruneConfig,
    SparsifyConfig,
    dumps_toml,
)
from leanlm.run.pipeline import run_pipeline
from leanlm.run.rundir import CONFIG_FILE
from leanlm.stages.base import StageResult
from leanlm.stages.lineage import pruned_layer_map_for
from leanlm.stages.sparsify import COMPRESSED_FILE
from sparse_kernels import load_compressed_

STAGES = ("pretrain", "prune", "distill", "sparsify", "control")


def _full_config(tiny_config, **pretrain):
    tiny = {"micro_batch_size": 4, "eval_batch_size": 4}  # the tiny run's batches (conftest)
    return tiny_config(
        stages=STAGES,
        pretrain={"steps": 120, "warmup_steps": 6, "eval_every": 60, "checkpoint_every": 60}
        | pretrain,
        prune=PruneConfig(hidden_size=16, intermediate_size=32, calibration_samples=16),
        distill=DistillConfig(steps=40, warmup_steps=4, eval_every=20, **tiny),
        sparsify=SparsifyConfig(
            steps=10, warmup_steps=2, eval_every=10, calibration_samples=16, **tiny
        ),
        control=ControlConfig(warmup_steps=2, eval_every=30, **tiny),
    )


@pytest.fixture(scope="module")
def full_run(shared_folder, tiny_config):
    # one run for all workers (shared: tests read it); results as each stage stored them
    config = _full_config(tiny_config)
    out = shared_folder("stages-full", lambda folder: run_pipeline(config, folder))
    return config, out, {stage: StageResult.load(out / stage) for stage in STAGES}


def test_every_stage_runs_and_reports(full_run):
    _, out, results = full_run
    assert list(results) == list(STAGES)
    report = (out / "report.md").read_text()
    for stage in STAGES:
        assert f"| {stage} |" in report
    for column in ("non-zero params", "weights on disk (MB)", "peak memory / process (MiB)"):
        assert column in report
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "size.png").stat().st_size > 1000
    pre, pruned = results["pretrain"].metrics, results["prune"].metrics
    assert pruned["params"] < pre["params"]
    assert results["distill"].metrics["params"] == pruned["params"]
    for stage in ("pretrain", "distill", "sparsify", "control"):
        assert results[stage].metrics["optimizer"] == "came"
        assert results[stage].metrics["bad_steps"] == 0


def test_each_stage_output_reloads_with_auto_classes(full_run):
    config, out, results = full_run
    ids = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(0))
    for stage, result in results.items():
        folder = out / result.model_dir
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert len(tokenizer) == model.config.vocab_size == config.tokenizer.vocab_size
        assert torch.isfinite(model(input_ids=ids).logits).all(), stage
    pruned = AutoModelForCausalLM.from_pretrained(out / "prune" / "model").config
    assert (pruned.hidden_size, pruned.intermediate_size) == (16, 32)


def test_distillation_beats_the_pruned_model(full_run):
    # Observed (tiny model, half width, 40 distillation steps): teacher 202, pruned 251,
    # distilled 209 validation perplexity. Asserted: distilled at least 10% below pruned.
    _, _, results = full_run
    pruned = results["prune"].metrics["val_perplexity"]
    distilled = results["distill"].metrics["val_perplexity"]
    assert distilled < 0.9 * pruned, (pruned, distilled)


def test_sparsified_model_is_2_4_sparse_on_disk_and_compact(full_run):
    _, out, results = full_run
    metrics = results["sparsify"].metrics
    weights = load_file(out / "sparsify" / "model" / "model.safetensors")
    linears = {k: w for k, w in weights.items() if ".layers." in k and w.dim() == 2}
    assert len(linears) == 2 * 7  # q k v o gate up down per layer
    for key, w in linears.items():
        groups = (w.reshape(w.shape[0], -1, 4) != 0).sum(-1)
        assert (groups <= 2).all(), key  # at most 2 non-zeros in every group of 4 inputs
    assert metrics["nonzero_params"] < metrics["stored_params"]
    assert metrics["masked_sparsity"] == pytest.approx(0.5)
    assert metrics["compressed_bytes"] < metrics["weights_bytes"]
    # the fine-tune moved the kept weights (masks held) and did not make things worse
    assert metrics["val_perplexity"] <= metrics["one_shot_val_perplexity"] * 1.02

    # the compact file reloads into the same architecture with identical outputs
    dense = AutoModelForCausalLM.from_pretrained(out / "sparsify" / "model").eval()
    fresh = AutoModelForCausalLM.from_pretrained(out / "distill" / "model").eval()
    load_compressed_(fresh, out / "sparsify" / COMPRESSED_FILE)
    ids = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(
        fresh(input_ids=ids).logits, dense(input_ids=ids).logits, atol=0, rtol=0
    )


def test_resume_between_stages_skips_finished_ones(full_run, tmp_path):
    # a run of the first two stages: the full run's (same config, same hashes), copied
    config, out, _ = full_run
    first = tmp_path / "run"
    for stage in STAGES[:2]:
        shutil.copytree(out / stage, first / stage)
    (first / CONFIG_FILE).write_text(dumps_toml(dataclasses.replace(config, stages=STAGES[:2])))
    before = (first / "prune" / "result.json").read_text()
    results = run_pipeline(config, first, resume=True)
    assert [r.stage for r in results] == list(STAGES)
    assert (first / "prune" / "result.json").read_text() == before  # not recomputed
    rows = (first / "distill" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(rows[-1])["step"] == config.distill.steps


def test_one_shot_sparsify_without_fine_tune(tmp_path, tiny_config):
    config = tiny_config(
        stages=("pretrain", "sparsify"),
        # more windows than the validation split has: the report states how many were scored
        data=dataclasses.replace(tiny_config().data, eval_windows=100_000),
        sparsify=SparsifyConfig(steps=0, pattern="unstructured", sparsity=0.7, method="magnitude"),
    )
    dense, sparse = run_pipeline(config, tmp_path / "run")
    metrics = sparse.metrics
    assert metrics["tokens"] == 0
    assert metrics["val_perplexity"] == pytest.approx(metrics["one_shot_val_perplexity"])
    # the note said "..., X after the sparse fine-tune" with no fine-tune run
    assert sparse.notes[0].startswith("70.0% of the decoder Linear weights are zero")
    says = f"perplexity {metrics['one_shot_val_perplexity']:.2f} right after one-shot pruning, "
    assert says + "no sparse fine-tune (`sparsify.steps` = 0). Its size" in sparse.notes[0]
    report = (tmp_path / "run" / "report.md").read_text()
    assert "after the sparse fine-tune" not in report
    windows = dense.metrics["eval_tokens"] // (config.data.seq_len - 1)  # first token unscored
    assert 0 < windows < 100_000
    assert (
        f"validation perplexity over {windows} windows of 32 tokens, spread evenly over the "
        f"validation split, all there are (`data.eval_windows` is 100000) (each window scored "
        "on its own; first token unscored). Every stage is scored on the same windows."
    ) in report
    assert metrics["masked_sparsity"] == pytest.approx(0.7, abs=0.01)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "sparsify" / "model")
    q = model.model.layers[0].self_attn.q_proj.weight
    assert (q == 0).float().mean() > 0.6  # zeros baked into the reloadable folder
    assert not (tmp_path / "run" / "sparsify" / "metrics.jsonl").exists()


def _prune_and_distill_pretrained(tiny_config, out, **distill):
    """The full run's config as `prune` + `distill` of its pretrained model (`init_model`)."""
    base = _full_config(tiny_config)
    return dataclasses.replace(
        base,
        init_model=str(out / "pretrain" / "model"),
        stages=("prune", "distill"),
        distill=dataclasses.replace(base.distill, teacher_stage="init", **distill),
    )


def test_init_model_runs_the_later_stages_on_an_existing_model(full_run, tmp_path, tiny_config):
    # The full run's pretrained model (and its saved tokenizer) as `init_model`: prune, and
    # distill with `teacher_stage = "init"`, reproduce the full run's stages exactly (same
    # weights, same token ids, same calibration and batches).
    _, out, original = full_run
    config = _prune_and_distill_pretrained(tiny_config, out)
    results = {r.stage: r for r in run_pipeline(config, tmp_path / "run")}
    for stage in ("prune", "distill"):
        got, expected = results[stage].metrics, original[stage].metrics
        assert got["params"] == expected["params"]
        assert got["val_perplexity"] == pytest.approx(expected["val_perplexity"], rel=1e-5)


def test_init_model_continues_pretraining(full_run, tmp_path, tiny_config):
    _, out, original = full_run
    config = tiny_config(pretrain={"steps": 4, "warmup_steps": 1, "checkpoint_every": 0})
    config = dataclasses.replace(config, init_model=str(out / "pretrain" / "model"))
    (result,) = run_pipeline(config, tmp_path / "run")
    first = json.loads((tmp_path / "run" / "pretrain" / "metrics.jsonl").read_text().split("\n")[0])
    # from scratch the first loss is ~ln(512) = 6.2; the loaded model starts where it ended
    assert first["loss"] < original["pretrain"].metrics["val_loss"] + 0.5
    assert result.metrics["params"] == original["pretrain"].metrics["params"]


def test_distill_with_hidden_loss_and_teacher_correction(full_run, tmp_path, tiny_config):
    # The full run's pretrained model as teacher, pruned to half width (a projection 16 -> 32 is
    # learned), its copy corrected for 2 steps, then 6 distillation steps with the hidden loss.
    _, out, original = full_run
    config = _prune_and_distill_pretrained(
        tiny_config,
        out,
        steps=6,
        warmup_steps=1,
        eval_every=6,
        checkpoint_every=3,
        hidden_loss_weight=1.0,
        teacher_correction_steps=2,
    )
    results = {r.stage: r for r in run_pipeline(config, tmp_path / "run")}
    metrics = results["distill"].metrics
    assert metrics["params"] == original["prune"].metrics["params"]  # projection not counted
    before, after = metrics["teacher_val_loss"], metrics["corrected_teacher_val_loss"]
    assert before == pytest.approx(original["pretrain"].metrics["val_loss"], rel=1e-5)
    assert after != before  # the teacher was fine-tuned
    lines = (tmp_path / "run" / "distill" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 6
    assert all(math.isfinite(x) for x in losses)
    folder = tmp_path / "run" / "distill" / "model"
    keys = set(load_file(folder / "model.safetensors"))
    assert not any(k.startswith(("student.", "hidden.")) for k in keys), sorted(keys)
    AutoModelForCausalLM.from_pretrained(folder)  # a plain checkpoint of the student
    # prune recorded where the student came from (width pruning keeps every layer in place),
    # and distill matched layers with that record since the teacher is the same model
    record = json.loads((tmp_path / "run" / "prune" / "model" / "pruned_from.json").read_text())
    assert record["source"] == os.path.relpath(out / "pretrain" / "model", tmp_path / "run")
    layers = config.model.num_hidden_layers
    assert record["layer_map"] == {str(i): i for i in range(layers)}


def test_pruned_layer_map_is_used_only_for_the_pruned_source(tmp_path):
    run = tmp_path / "run"
    student, teacher, other = run / "prune" / "model", run / "pretrain" / "model", tmp_path / "x"
    student.mkdir(parents=True)
    assert pruned_layer_map_for(run, student, teacher) == {}  # not written by prune
    record = {"source": "pretrain/model", "layer_map": {"0": 0, "1": 2, "2": 3}}
    (student / "pruned_from.json").write_text(json.dumps(record))
    assert pruned_layer_map_for(run, student, teacher) == {0: 0, 1: 2, 2: 3}
    assert pruned_layer_map_for(run, student, other) == {}  # another teacher: even map instead


def _search_pretrained(tiny_config, tiny_search, out, **search):
    """`prune` alone on the full run's pretrained model, its shape found by the search."""
    base = _full_config(tiny_config)
    prune = tiny_search(search_steps=8, search_lr=3e-3, **search)
    return dataclasses.replace(
        base, init_model=str(out / "pretrain" / "model"), stages=("prune",), prune=prune
    )


def test_prune_search_saves_the_shape_with_the_lowest_distilled_loss(
    full_run, tmp_path, tiny_config, tiny_search
):
    config, out, original = full_run
    budget = int(0.6 * original["pretrain"].metrics["params"])  # 20,985 (34,976 params)
    search = _search_pretrained(tiny_config, tiny_search, out, search_params=budget)
    (result,) = run_pipeline(search, tmp_path / "run")
    m = result.metrics
    rows = m["search"]
    # 24/32/2 (21,624), 32/32/1 (22,624) and 24/64/1 (19,272) of the 12 shapes are within ±10%
    assert len(rows) == 3
    assert all(abs(r["params"] - budget) <= 0.1 * budget for r in rows)
    distilled = [r["val_loss_distilled"] for r in rows]
    assert distilled == sorted(distilled)
    assert distilled[0] < distilled[-1]
    assert all(r["val_loss_distilled"] < r["val_loss_pruned"] for r in rows)  # it distilled
    best = rows[0]  # the lowest validation loss after distillation
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "prune" / "model")
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads) == (
        best["num_hidden_layers"],
        best["hidden_size"],
        best["intermediate_size"],
        best["num_attention_heads"],
    )
    assert sum(p.numel() for p in model.parameters()) == m["params"] == best["params"]
    # saved as pruned, not distilled: the stage's validation loss is the row's pruned loss
    assert m["val_loss"] == pytest.approx(best["val_loss_pruned"], rel=1e-5)
    seq = config.data.seq_len
    assert m["search_tokens"] == 3 * 8 * 4 * seq
    assert m["tokens"] == 16 * seq + m["search_tokens"]
    shape = (
        f"{best['num_hidden_layers']} layers, hidden {best['hidden_size']}, MLP "
        f"{best['intermediate_size']}, {best['num_attention_heads']} heads"
    )
    assert f"chosen: {shape} ({best['params']:,} params)" in result.notes[0]
    assert len(result.notes) == 1 + len(rows)
    assert result.notes[1].startswith(f"search rank 1: {shape}")
    report = (tmp_path / "run" / "report.md").read_text()
    assert "- `prune`: search rank 3: " in report


def test_prune_search_budget_no_shape_fits(full_run, tmp_path, tiny_config, tiny_search):
    _, out, _ = full_run
    search = _search_pretrained(tiny_config, tiny_search, out, search_params=9_000)
    with pytest.raises(ConfigError) as info:
        run_pipeline(search, tmp_path / "run")
    assert info.value.key == "prune.search_params"
    assert "(9,000): no shape of the search space" in str(info.value)
    assert "12 valid shapes have from 11,312 to 34,976" in str(info.value)


def test_control_trains_the_dense_model_for_the_compression_tokens(full_run):
    config, out, results = full_run
    seq = config.data.seq_len
    # prune: calibration; distill: steps x batch; sparsify: fine-tune + calibration
    expected = (
        config.prune.calibration_samples * seq
        + config.distill.steps * config.distill.micro_batch_size * seq
        + config.sparsify.steps * config.sparsify.micro_batch_size * seq
        + config.sparsify.calibration_samples * seq
    )
    m = {stage: r.metrics for stage, r in results.items()}
    used = sum(
        m[s]["tokens"] + m[s].get("calibration_tokens", 0) for s in ("prune", "distill", "sparsify")
    )
    assert used == expected == 7424
    assert m["control"]["tokens"] == m["control"]["target_tokens"] == expected  # 58 steps of 128
    rows = (out / "control" / "metrics.jsonl").read_text().splitlines()
    assert max(json.loads(r)["step"] for r in rows) == 58
    # the dense model (pretrain's architecture), trained on: as large as pretrain's
    assert m["control"]["params"] == m["pretrain"]["params"]
    assert m["control"]["val_perplexity"] != m["pretrain"]["val_perplexity"]


def _table_rows(report):
    rows = {}
    lines = report.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| stage |"))
    titles = [c.strip() for c in lines[header].strip("|").split("|")]
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(titles, cells, strict=True))
    return rows


def test_report_rows_notes_models_and_samples(full_run):
    _, out, results = full_run
    report = (out / "report.md").read_text()
    rows = _table_rows(report)
    assert list(rows) == list(STAGES)
    for stage, result in results.items():
        m = result.metrics
        row = rows[stage]
        assert (
            row["val perplexity"] == f"{m['val_perplexity']:.3f}"
            or row["val perplexity"] == f"{m['val_perplexity']:,.0f}"
        )
        assert row["params (M)"] == f"{m['params'] / 1e6:.3f}"
        assert row["tokens"] == f"{m['tokens']:,}"
        # loading snippet with this stage's folder, and a greedy sample under it
        folder = (out / result.model_dir).as_posix()
        assert f'AutoModelForCausalLM.from_pretrained("{folder}")' in report
        assert f'AutoTokenizer.from_pretrained("{folder}")' in report
        assert f"### {stage}\n" in report
    # the sparse row's disk size is the compact file's
    assert rows["sparsify"]["weights on disk (MB)"] == (
        f"{results['sparsify'].metrics['compressed_bytes'] / 1e6:.3f}"
    )
    assert report.count("```text\ndef main():\n    ") == len(STAGES)
    sparse, control = results["sparsify"].metrics, results["control"].metrics
    delta = sparse["val_perplexity"] - control["val_perplexity"]
    assert "What compression cost at equal tokens" in report
    assert f"{sparse['val_perplexity']:.2f}" in report
    assert f"{delta:+.2f} ({delta / control['val_perplexity']:+.1%})" in report
    for field in ("- Command: `", "- Commit: `", "torch 2.", "transformers ", "accelerate "):
        assert field in report
    assert "its training loss is KL to teacher" in report


def test_peak_memory_is_measured_per_stage(full_run):
    _, _, results = full_run
    peaks = [r.metrics["peak_rss_mib"] for r in results.values()]
    assert all(p > 0 for p in peaks)


def test_peak_memory_window_resets():
    # A stage's peak is its own: a freed 256 MiB from before the reset is not in the next window.
    # (Comparing two stages' peaks in the full run depended on what the test process held.)
    import torch

    from leanlm.report.metrics import peak_memory_mib, reset_peak_memory

    cpu = torch.device("cpu")
    big = torch.ones(64 * 2**20)  # 256 MiB, every page written
    before = peak_memory_mib(cpu)
    del big
    reset_peak_memory(cpu)
    assert before - peak_memory_mib(cpu) > 200


def test_kl_is_drawn_on_its_own_axes(full_run):
    from leanlm.report.plots import loss_figure, size_figure

    _, out, results = full_run
    fig = loss_figure(out, list(results.values()))
    ce_ax, kl_ax = fig.axes
    ce_labels = [line.get_label() for line in ce_ax.lines]
    kl_labels = [line.get_label() for line in kl_ax.lines]
    assert kl_labels == ["distill train"]
    assert "distill train" not in ce_labels
    assert {"pretrain train", "sparsify train", "control train", "distill val"} <= set(ce_labels)
    assert "KL to teacher" in kl_ax.get_title()
    assert ce_ax.get_title()
    assert fig._suptitle is not None
    assert fig.get_layout_engine() is not None
    # the KL axes hold distill's logged losses, the same numbers as its metrics.jsonl
    rows = [json.loads(r) for r in (out / "distill" / "metrics.jsonl").read_text().splitlines()]
    assert list(kl_ax.lines[0].get_ydata()) == [r["loss"] for r in rows if "loss" in r]

    size = size_figure(list(results.values()))
    (ax,) = size.axes
    assert "millions" in ax.get_xlabel()
    assert ax.get_title()
    xs = sorted(float(c.get_offsets()[0][0]) for c in ax.collections)
    expected = sorted(
        r.metrics["nonzero_params"] / 1e6
        for r in results.values()
        if "one_shot_val_perplexity" not in r.metrics
    )
    assert all(x < 1 for x in xs)  # millions, not raw counts
    for e in expected:
        assert any(abs(x - e) < 1e-9 for x in xs), (e, xs)
