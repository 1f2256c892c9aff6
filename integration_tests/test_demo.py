"""The README's main job, `leanlm demo --preset smoke`, end to end in a fresh process."""

import json
import os
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_smoke_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    env = {**os.environ, "LEANLM_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "leanlm", "demo", "--preset", "smoke", "--out", str(out)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    report = (out / "report.md").read_text()
    assert "| pretrain |" in report
    assert "![loss curves](loss.png)" in report
    assert (out / "loss.png").is_file()
    result = json.loads((out / "pretrain" / "result.json").read_text())
    assert 100_000 < result["metrics"]["params"] < 1_000_000
    # Uniform guessing over the 2048-token vocabulary has perplexity 2048; the smoke model must
    # have learned a lot more than that (measured: ~400 after 200 steps).
    assert result["metrics"]["val_perplexity"] < 1000

    folder = out / "pretrain" / "model"
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("import sys\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 8
    assert isinstance(tokenizer.decode(generated[0]), str)
