"""`[eval]` (lm-evaluation-harness on every stage's model) and `[logging] wandb` (offline).

One tiny pretrain run scores a local multiple-choice task over a local jsonl (no download) and
logs to an offline W&B run; the accuracy is checked against log-likelihoods computed here.
"""

import dataclasses
import json
import shutil
import struct
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from leanlm import ConfigError, load_toml
from leanlm.cli import main
from leanlm.config import dumps_toml
from leanlm.report.downstream import EvalConfig, run_tasks, scores, task_manager
from leanlm.report.metrics import LoggingConfig, read_metrics
from leanlm.run.pipeline import run_pipeline
from leanlm.stages import StageResult

pytest.importorskip("lm_eval", reason="needs leanlm[eval]")
pytest.importorskip("wandb", reason="needs leanlm[wandb]")

ITEMS = [
    ("def main():", ["return 0", "import os", "class A:"]),
    ("for i in range(10):", ["print(i)", "pass", "break"]),
    ("The cat sat on the", ["mat", "dog", "import"]),
    ("import", ["os", "sys", "the"]),
]
"""(question, choices): the task's documents; each test picks the gold labels."""

TASK_YAML = """task: {name}
tag: leanlm_tiny_tasks
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""


def write_task(folder, name, labels):
    """A multiple-choice task `name` over a local jsonl of `ITEMS` with gold `labels`."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    rows = [
        {"question": q, "choices": c, "label": y} for (q, c), y in zip(ITEMS, labels, strict=True)
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{name}.yaml").write_text(TASK_YAML.format(name=name, data=data))
    return folder


@torch.no_grad()
def log_likelihoods(model, tokenizer):
    """Per item, each choice's summed log-probability given the question, computed here.

    lm-eval scores the continuation " " + choice after the question: the tokens of
    question + " " + choice past those of the question alone.
    """
    out = []
    for question, choices in ITEMS:
        context = tokenizer(question)["input_ids"]
        row = []
        for choice in choices:
            whole = tokenizer(question + " " + choice)["input_ids"]
            logp = model(torch.tensor([whole])).logits[0].double().log_softmax(-1)
            row.append(sum(logp[t - 1, whole[t]].item() for t in range(len(context), len(whole))))
        out.append(row)
    return out


def hand_accuracy(lls, labels):
    """The share of items whose gold choice has the highest log-likelihood."""
    return sum(
        max(range(len(r)), key=r.__getitem__) == y for r, y in zip(lls, labels, strict=True)
    ) / len(lls)


def wandb_records(path):
    """The records of an offline `.wandb` file (wandb's LevelDB-style log of protobuf Records).

    wandb 0.31 ships no Python reader for it; the framing is a 7-byte header, then 32 KiB
    blocks of chunks (crc32 4 B, length 2 B little-endian, type 1 B: full/first/middle/last).
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last chunk: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_folder):
    """(history rows, summary) of the offline W&B run in `run_folder`."""
    (path,) = run_folder.glob("run-*.wandb")
    rows, summary = [], {}

    def items(entries):  # wandb-core writes the key as one `nested_key` element
        return {e.key or "/".join(e.nested_key): json.loads(e.value_json) for e in entries}

    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append(items(record.history.item))
        elif kind == "summary":
            summary.update(items(record.summary.update))
    return rows, summary


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_config):
    """A tiny pretrain run with `[eval]` on a local task and W&B in offline mode."""
    root = tmp_path_factory.mktemp("downstream")
    tasks = write_task(root / "tasks", "tiny_mc", [0, 1, 2, 0])
    config = tiny_config(
        eval=EvalConfig(
            lm_eval_tasks=("tiny_mc",),
            lm_eval_include_path=str(tasks),
            lm_eval_include_defaults=False,
        ),
        logging=LoggingConfig(wandb=True, project="leanlm-tests", run_name="tiny-offline"),
    )
    out = root / "run"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.delenv("WANDB_DIR", raising=False)  # leanlm's default: the run folder
        env.setenv("WANDB_CONFIG_DIR", str(root / "wandb-config"))
        env.setenv("WANDB_CACHE_DIR", str(root / "wandb-cache"))
        env.setenv("WANDB_DATA_DIR", str(root / "wandb-data"))
        results = run_pipeline(config, out)
    return config, out, results


def test_lm_eval_accuracy_and_log_likelihoods_match_a_hand_computation(run, tmp_path):
    _, out, _ = run
    folder = out / "pretrain" / "model"
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    lls = log_likelihoods(model, tokenizer)
    best = [max(range(3), key=row.__getitem__) for row in lls]
    # Gold = the model's favourite on items 0-2, another choice on item 3: accuracy 3/4.
    labels = [*best[:3], (best[3] + 1) % 3]
    cfg = EvalConfig(
        lm_eval_tasks=("picked",),
        lm_eval_include_path=str(write_task(tmp_path, "picked", labels)),
        lm_eval_include_defaults=False,
    )
    results = run_tasks(model, tokenizer, cfg, manager=task_manager(cfg), log_samples=True)
    score = scores(results, cfg)["picked"]
    assert score["metric"] == "acc"
    assert score["value"] == pytest.approx(0.75)
    assert score["samples"] == 4
    assert score["stderr"] == pytest.approx((0.75 * 0.25 / 3) ** 0.5)  # sample std / sqrt(n)
    samples = sorted(results["samples"]["picked"], key=lambda s: s["doc_id"])
    reported = [[resp[0] for resp in s["filtered_resps"]] for s in samples]
    assert reported == [pytest.approx(row, abs=1e-4) for row in lls]


def test_each_stage_gets_its_task_scores_in_result_json_and_the_report(run):
    _, out, results = run
    folder = out / "pretrain" / "model"
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    expected = hand_accuracy(
        log_likelihoods(model, AutoTokenizer.from_pretrained(folder)), [0, 1, 2, 0]
    )
    score = results[0].metrics["lm_eval"]["tiny_mc"]
    assert score["metric"] == "acc"
    assert score["samples"] == 4
    assert score["value"] == pytest.approx(expected)
    assert StageResult.load(out / "pretrain").metrics["lm_eval"] == {"tiny_mc": score}
    stored = json.loads((out / "pretrain" / "lm_eval.json").read_text())
    assert stored["results"]["tiny_mc"]["acc,none"] == pytest.approx(expected)
    report = (out / "report.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| stage |"))
    assert header.endswith("| tiny_mc (acc) |")
    row = next(line for line in report.splitlines() if line.startswith("| pretrain |"))
    assert row.endswith(f"| {expected:.3f} |")
    assert "`tiny_mc` 4" in report
    assert "`acc` is accuracy" in report


def test_wandb_offline_run_holds_the_tensorboard_scalars(run):
    _, out, _ = run
    (folder,) = (out / "wandb").glob("offline-run-*")
    assert folder.name.endswith((out / "wandb_run_id").read_text().strip())
    rows, summary = wandb_history(folder)
    logged = read_metrics(out / "pretrain" / "metrics.jsonl")
    for key in ("loss", "lr", "grad_norm", "val_loss", "val_perplexity", "tokens_per_s"):
        expected = {r["step"]: r[key] for r in logged if key in r}
        got = {r["pretrain/step"]: r[f"pretrain/{key}"] for r in rows if f"pretrain/{key}" in r}
        assert got == pytest.approx(expected, rel=1e-6), key
        assert summary[f"pretrain/{key}"] == pytest.approx(expected[max(expected)], rel=1e-6)
    assert summary["pretrain/step"] == 12


def test_resume_scores_only_the_missing_tasks_and_continues_the_wandb_run(run, tmp_path):
    config, out, results = run
    moved = tmp_path / "run"
    shutil.copytree(out, moved)
    tasks = write_task(tmp_path / "tasks", "tiny_mc2", [1, 1, 1, 1])
    shutil.copy(config.eval.lm_eval_include_path + "/tiny_mc.yaml", tasks)
    eval_cfg = dataclasses.replace(
        config.eval, lm_eval_tasks=("tiny_mc", "tiny_mc2"), lm_eval_include_path=str(tasks)
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_DIR", str(moved / "wandb-elsewhere"))
        env.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
        again = run_pipeline(dataclasses.replace(config, eval=eval_cfg), moved, resume=True)
    scored = again[0].metrics["lm_eval"]
    assert scored["tiny_mc"] == results[0].metrics["lm_eval"]["tiny_mc"]  # kept, not rerun
    assert scored["tiny_mc2"]["samples"] == 4
    assert "tiny_mc2 (acc)" in (moved / "report.md").read_text()
    (folder,) = (moved / "wandb-elsewhere" / "wandb").glob("offline-run-*")
    assert folder.name.endswith((out / "wandb_run_id").read_text().strip())  # the same run


@pytest.mark.parametrize(
    ("section", "package", "hint"),
    [
        ('[eval]\nlm_eval_tasks = ["hellaswag"]', "lm_eval", "pip install leanlm[eval]"),
        ("[logging]\nwandb = true", "wandb", "pip install leanlm[wandb]"),
    ],
)
def test_a_missing_optional_package_stops_with_one_line(
    tmp_path, capsys, monkeypatch, section, package, hint
):
    path = tmp_path / "c.toml"
    path.write_text(f"{section}\n")
    monkeypatch.setitem(sys.modules, package, None)  # find_spec then reports it missing
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].endswith(hint)
    assert not (tmp_path / "out" / "pretrain").exists()


@pytest.mark.parametrize(
    ("task", "text"),
    [
        ("tiny_mcq", "unknown lm-eval task 'tiny_mcq' (not a task, group or tag under"),
        ("tiny_mcq", "; did you mean 'tiny_mc'?"),
        ("leanlm_tiny_tasks", "'leanlm_tiny_tasks' is an lm-eval tag"),
        ("leanlm_tiny_tasks", "list its tasks instead (tiny_mc)"),
    ],
)
def test_an_unknown_task_or_a_tag_is_refused_naming_the_key(tmp_path, capsys, task, text):
    tasks = write_task(tmp_path / "tasks", "tiny_mc", [0, 0, 0, 0])
    path = tmp_path / "c.toml"
    path.write_text(
        f'[eval]\nlm_eval_tasks = ["{task}"]\nlm_eval_include_path = "{tasks}"\n'
        "lm_eval_include_defaults = false\n"
    )
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("leanlm: error: config key `eval.lm_eval_tasks`: ")
    assert text in line


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"eval": {"lm_eval_limit": -1}}, "eval.lm_eval_limit"),
        ({"eval": {"lm_eval_batch_size": 0}}, "eval.lm_eval_batch_size"),
        ({"eval": {"lm_eval_tasks": ["a", "a"]}}, "eval.lm_eval_tasks"),
        ({"eval": {"lm_eval_taks": ["a"]}}, "eval.lm_eval_taks"),
        ({"logging": {"project": "a/b"}}, "logging.project"),
        ({"logging": {"wandb": "yes"}}, "logging.wandb"),
    ],
)
def test_bad_eval_and_logging_values_name_the_key(tmp_path, data, key):
    from leanlm.config import RunConfig, from_dict

    with pytest.raises(ConfigError) as err:
        from_dict(RunConfig, data)
    assert err.value.key == key


def test_eval_and_logging_round_trip_through_toml(tmp_path, tiny_config):
    config = tiny_config(
        eval=EvalConfig(lm_eval_tasks=("mmlu", "winogrande"), lm_eval_num_fewshot=5),
        logging=LoggingConfig(wandb=True, entity="team", run_name="x"),
    )
    path = tmp_path / "c.toml"
    path.write_text(dumps_toml(config))
    assert load_toml(path) == config
