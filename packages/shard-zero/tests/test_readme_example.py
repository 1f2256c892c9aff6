"""The README's quick start runs as written (world 1, gloo) and trains as plain torch does.

Its free names are defined first: `model` (a tiny Llama) and `loader` (batches with labels).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from leanlm_testing.models import random_batches, tiny_llama
from leanlm_testing.readme import run_blocks

README = Path(__file__).resolve().parents[1] / "README.md"


def _loader() -> list[dict[str, torch.Tensor]]:
    batches = random_batches(256, batches=3, batch_size=2, seq_len=12)
    return [{**b, "labels": b["input_ids"]} for b in batches]


def test_quick_start_runs_and_trains_as_plain_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as s:  # a free port for the example's env:// rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.chdir(tmp_path)  # the example writes "ckpt"
    try:
        ns = run_blocks(README, [0], {"model": tiny_llama().train(), "loader": _loader()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert (tmp_path / "ckpt").is_dir()
    plain = tiny_llama().train()
    opt = torch.optim.AdamW(plain.parameters(), lr=3e-4)
    for batch in _loader():
        plain(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    want = plain.state_dict()
    assert set(ns["state"]) == set(want)  # original keys
    for name, value in want.items():
        assert ns["state"][name].device.type == "cpu"
        torch.testing.assert_close(ns["state"][name], value, atol=1e-6, rtol=1e-5, msg=name)
    assert not torch.equal(want["lm_head.weight"], tiny_llama().state_dict()["lm_head.weight"])
