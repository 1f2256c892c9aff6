"""The report's "MiB of model state per process" counts what ZeRO-Offload keeps on the host.

Before, with `zero_offload_optimizer` it was `memory_stats()["total"]` (the device only): the
fp32 masters and the optimizer state, moved to the host, vanished from the number (0.13 MiB
against 0.44 MiB without offload, on bit-equal runs).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from leanlm.report.markdown import notes
from leanlm.stages.base import StageResult
from leanlm.train.engines import ZeroEngine
from leanlm_testing.distributed import single_process_group


def _engine(offload: bool) -> ZeroEngine:
    cfg = SimpleNamespace(
        zero_stage=2, zero_accum_dtype="fp32", zero_offload_accum=False,
        zero_offload_optimizer=offload,
    )  # fmt: skip
    engine = ZeroEngine(None, cfg)  # type: ignore[arg-type]  # `wrap` reads only `cfg`
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 8))
    engine.wrap(model, lambda params: torch.optim.AdamW(params, lr=1e-3))
    engine.model(torch.randn(4, 64)).sum().backward()
    engine.optimizer.step()
    return engine


@pytest.mark.parametrize("offload", [False, True])
def test_model_state_counts_host_memory(tmp_path: Path, offload: bool) -> None:
    from shard_zero import memory_stats

    with single_process_group("cpu", tmp_path):
        engine = _engine(offload)
        stats = memory_stats(engine.model, engine.optimizer)
        total = engine.model_state_mib()
        host = engine.host_state_mib()
    n = sum(p.numel() for p in engine.model.parameters())
    assert total is not None
    # params, fp32 masters (aliasing the fp32 params without offload), AdamW's two moments
    assert total * 2**20 >= 3 * 4 * n
    assert total * 2**20 == stats["total"] + stats["host_total"]
    if not offload:
        assert host is None
        assert stats["host_total"] == 0
        return
    assert host is not None
    # the fp32 masters and both moments live on the host, the gradients' host copies too
    assert host * 2**20 == stats["host_total"] >= 3 * 4 * n + stats["host_grads"]
    assert stats["host_grads"] > 0
    metrics = {"parallel": "ZeRO-2", "processes": 1, "optimizer": "adamw",
               "model_state_mib": total, "model_state_host_mib": host}  # fmt: skip
    report = notes([StageResult("pretrain", "hash", "pretrain/model", metrics)])
    assert f"{total:.1f} MiB of model state per process ({host:.1f} MiB of it in host" in report
