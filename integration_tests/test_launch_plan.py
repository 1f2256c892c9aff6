"""tools/launch_plan.py: the launches of a fused CAME / Adafactor step at real sizes, on CPU.

The tool runs without TRITON_INTERPRET (the GPU's tiles), on meta tensors. The targets of the
work split are checked on its records: every launch gives a program at most 65,536 elements,
every launch moving more than 64 MB has at least 4 x 132 programs and max/mean elements per
program <= 2; and each pass covers every parameter element.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "launch_plan.py"
#: elements of the matrices of each case (TinyLlama 1.1B; bench_came's 336M set)
MATRIX_ELEMENTS = {
    "tinyllama-1.1b": 2 * 32000 * 2048 + 22 * (2 * 2048 * 2048 + 2 * 256 * 2048 + 3 * 5632 * 2048),
    "bench-336m": 2 * 32000 * 2048 + 4 * (4 * 2048 * 2048 + 3 * 5632 * 2048),
}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(TOOL), "--out", str(out), "--check"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())["records"]


def test_every_big_launch_fills_an_h100_evenly(records):
    keys = {"optimizer", "case", "kernel", "programs", "max_elements", "mean_elements", "bytes"}
    assert all(set(r) == keys for r in records)
    assert {(r["optimizer"], r["case"]) for r in records} >= {
        (o, c) for o in ("came", "adafactor") for c in MATRIX_ELEMENTS
    }
    big = [r for r in records if r["bytes"] > 64 * 2**20]
    assert len(big) >= 20
    for r in big:
        assert r["programs"] >= 4 * 132, r
        assert r["max_elements"] <= 2 * r["mean_elements"], r


@pytest.mark.parametrize("case", list(MATRIX_ELEMENTS))
def test_each_pass_covers_every_element_once(records, case):
    kernels = {
        "came": ["_mt_stats_kernel", "_mt_momentum_kernel", "_mt_came_apply_kernel"],
        "adafactor": ["_mt_stats_kernel", "_mt_apply_kernel"],
    }
    for optimizer, passes in kernels.items():
        recs = [r for r in records if r["case"] == case and r["optimizer"] == optimizer]
        for kernel in passes:
            mine = [r for r in recs if r["kernel"] == kernel]
            covered = sum(r["programs"] * r["mean_elements"] for r in mine)
            rounding = sum(0.05 * r["programs"] for r in mine)  # means are written to 0.1
            assert abs(covered - MATRIX_ELEMENTS[case]) <= rounding, (optimizer, kernel)
        apply = "_mt_came_apply_kernel" if optimizer == "came" else "_mt_apply_kernel"
        bf16_apply = sum(r["bytes"] for r in recs if r["kernel"] == apply)
        per_element = 6  # bf16 (CAME: m + 2p; Adafactor without momentum: g + 2p)
        assert bf16_apply == per_element * MATRIX_ELEMENTS[case]
