"""Two gloo processes (torchrun -> accelerate) train like one process with the same global batch.

Replicated (DDP) and sharded with shard-zero (ZeRO-2 with CAME, ZeRO-3 with Adafactor: the
factored optimizers stay exact because shards are whole rows).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from leanlm.config import dumps_toml


def _losses(run_dir):
    rows = [
        json.loads(line)
        for line in (run_dir / "pretrain" / "metrics.jsonl").read_text().splitlines()
    ]
    return torch.tensor([r["loss"] for r in rows if "loss" in r], dtype=torch.float64)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("optimizer", "zero_stage", "offload"),
    [("adamw", 0, False), ("came", 2, False), ("adafactor", 3, False), ("came", 3, True)],
)
def test_two_processes_match_one_with_the_same_global_batch(
    tmp_path, tiny_config, optimizer, zero_stage, offload
):
    # Global batch 8 either way: 1 process x 4 sequences x 2 accumulation steps, or
    # 2 processes x 4 sequences x 1 step (gradients averaged over gloo by DDP or shard-zero),
    # or (offload) 2 processes x 2 sequences x 2 micro-batches, the first under no_sync with
    # the sharded accumulator in host memory.
    common = {"steps": 20, "micro_batch_size": 4, "optimizer": optimizer}
    one = tiny_config(pretrain={**common, "grad_accum_steps": 2})
    sharded = {"grad_accum_steps": 1, "zero_stage": zero_stage}
    if offload:
        sharded |= {"micro_batch_size": 2, "grad_accum_steps": 2, "zero_offload_accum": True}
    two = tiny_config(pretrain={**common, **sharded})
    (tmp_path / "one.toml").write_text(dumps_toml(one))
    (tmp_path / "two.toml").write_text(dumps_toml(two))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "leanlm", "run", tmp_path / "one.toml", "--out", tmp_path / "one"],
        check=True,
        capture_output=True,
        env=env,
        timeout=300,
    )
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    two_run = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "leanlm",
            "run",
            tmp_path / "two.toml",
            "--out",
            tmp_path / "two",
        ],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert two_run.returncode == 0, two_run.stderr[-3000:]
    expected = f"on 2 process(es) ZeRO-{zero_stage}" if zero_stage else "on 2 process(es) DDP"
    assert expected in two_run.stdout + two_run.stderr

    result = json.loads((tmp_path / "two" / "pretrain" / "result.json").read_text())
    assert result["metrics"]["processes"] == 2
    if zero_stage:
        assert result["metrics"]["model_state_mib"] > 0
    # fp32 sums in a different order (per-rank then all-reduce vs. sequential accumulation, and
    # for the sharded runs cross-rank sums of the factored statistics) perturb gradients by
    # ~1e-7 relative; over 20 steps that stays below 1e-5 in the loss.
    torch.testing.assert_close(
        _losses(tmp_path / "two"), _losses(tmp_path / "one"), atol=1e-5, rtol=1e-5
    )
    a = load_file(tmp_path / "one" / "pretrain" / "model" / "model.safetensors")
    b = load_file(tmp_path / "two" / "pretrain" / "model" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=2e-5, rtol=1e-4, msg=name)
