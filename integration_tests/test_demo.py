"""The README's main job, `leanlm demo --preset smoke`, end to end in fresh processes.

One process, and two gloo processes started by the demo itself (`--processes 2` -> torchrun; the
training stages then run sharded with shard-zero ZeRO-2 and CAME).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

STAGES = ["pretrain", "prune", "distill", "sparsify", "control"]


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_smoke_demo_end_to_end(tmp_path, nproc):
    out = tmp_path / "demo"
    env = {**os.environ, "LEANLM_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "leanlm", "demo", "--preset", "smoke", "--out", str(out)]
    done = subprocess.run(
        [*cmd, "--processes", str(nproc)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    report = (out / "report.md").read_text()
    for stage in STAGES:
        assert f"| {stage} |" in report
    assert "![loss curves](loss.png)" in report
    assert (out / "loss.png").is_file()
    assert (out / "size.png").is_file()
    metrics = {
        stage: json.loads((out / stage / "result.json").read_text())["metrics"] for stage in STAGES
    }
    assert all(m["processes"] == nproc for m in metrics.values())
    if nproc == 2:
        assert metrics["pretrain"]["parallel"] == "ZeRO-2"
    assert 100_000 < metrics["pretrain"]["params"] < 1_000_000
    assert metrics["prune"]["params"] < 0.8 * metrics["pretrain"]["params"]
    # Uniform guessing over the 2048-token vocabulary has perplexity 2048; the smoke model must
    # have learned a lot more than that (measured: 245 with 1 process, 173 with 2).
    assert metrics["pretrain"]["val_perplexity"] < 1000
    # Measured: pruned 299 -> distilled 248 (1 process), 242 -> 177 (2 processes).
    assert metrics["distill"]["val_perplexity"] < 0.95 * metrics["prune"]["val_perplexity"]
    assert metrics["sparsify"]["nonzero_params"] < metrics["sparsify"]["stored_params"]
    # control: the dense model, trained on for exactly the compression stages' tokens
    used = sum(
        metrics[s]["tokens"] + metrics[s].get("calibration_tokens", 0)
        for s in ("prune", "distill", "sparsify")
    )
    assert metrics["control"]["tokens"] == used
    assert metrics["control"]["params"] == metrics["pretrain"]["params"]
    assert "What compression cost at equal tokens" in report

    for stage in STAGES:
        folder = out / stage / "model"
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids = tokenizer("import sys\n", return_tensors="pt")["input_ids"]
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=8, do_sample=False)
        assert generated.shape[1] == ids.shape[1] + 8, stage
        assert isinstance(tokenizer.decode(generated[0]), str)
