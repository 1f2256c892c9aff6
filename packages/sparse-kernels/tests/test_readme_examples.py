"""The README's examples run as written and do what their comments say.

Free names are defined first: `model` (a small Llama whose Linears are multiples of 64 wide),
`calibration_ids`, `batch`, `linear`, `x`, `loader`, `opt`, `fresh_model`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from leanlm_testing.models import random_batches, tiny_llama
from leanlm_testing.readme import run_blocks

README = Path(__file__).resolve().parents[1] / "README.md"


def _model() -> Any:
    """Every decoder Linear a multiple of 64 wide, with 8-32 tiles of 64x64 (none emptied)."""
    return tiny_llama(hidden_size=256, intermediate_size=512).train()


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    return [{**b, "labels": b["input_ids"]} for b in random_batches(256, batches=n)]


def test_quick_start_and_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)  # the export example writes "out/" and a .safetensors file
    torch.manual_seed(0)
    model = _model()
    linear = nn.Linear(256, 256)
    ns: dict[str, Any] = {
        "torch": torch,
        "model": model,
        "calibration_ids": [b["input_ids"] for b in _batches(2)],
        "batch": _batches(1)[0],
        "linear": linear,
        "x": torch.randn(5, 256),
        "AutoModelForCausalLM": AutoModelForCausalLM,
        "fresh_model": _model(),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. a layer emptied by the rounding
        run_blocks(README, [0], ns)
    # the one-shot 2:4 Wanda masks: 2 of every 4 input weights kept in every decoder Linear
    assert len(ns["masks"]) == 14
    for name, mask in ns["masks"].items():
        assert (mask.reshape(mask.shape[0], -1, 4).sum(-1) == 2).all(), name
    # the block-sparse Linear: 10% of its 16 tiles stored, same shape, same values in them
    layer = ns["layer"]
    assert ns["y"].shape == linear(ns["x"]).shape
    dense = layer.to_dense()
    kept = dense.reshape(4, 64, 4, 64).abs().sum((1, 3)) != 0
    assert int(kept.sum()) == 2  # 10% of 16 tiles, rounded
    torch.testing.assert_close(ns["y"], nn.functional.linear(ns["x"], dense, linear.bias))
    # block masks on the decoder Linears: round(0.875 * tiles) of each one's 64x64 tiles zero
    for name, lin in model.named_modules():
        if isinstance(lin, nn.Linear) and ".layers." in name:
            out_f, in_f = lin.weight.shape
            tiles = lin.weight.reshape(out_f // 64, 64, in_f // 64, 64).abs().sum((1, 3))
            assert int((tiles == 0).sum()) == round(0.875 * tiles.numel()), name
    assert (model.model.embed_tokens.weight != 0).all()
    ids = ns["batch"]["input_ids"]
    with torch.no_grad():
        want = model(input_ids=ids).logits
    run_blocks(README, [2], ns)
    with torch.no_grad():
        torch.testing.assert_close(ns["m"](input_ids=ids).logits, want)  # identical outputs
        torch.testing.assert_close(ns["fresh_model"](input_ids=ids).logits, want)
    assert ns["nbytes"] > 0
    assert (tmp_path / "model.sparse.safetensors").stat().st_size == ns["nbytes"]


def test_training_schedule_example() -> None:
    torch.manual_seed(0)
    model = _model()
    ns: dict[str, Any] = {
        "model": model,
        "loader": _batches(3),
        "opt": torch.optim.AdamW(model.parameters(), lr=1e-3),
    }
    run_blocks(README, [1], ns)
    assert ns["schedule"].step_count == 3
