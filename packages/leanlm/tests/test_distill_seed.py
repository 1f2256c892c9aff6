"""A distill run with the hidden-state loss is reproducible: its projection is seeded by `seed`."""

import json

import torch
from safetensors.torch import load_file

from leanlm.run.pipeline import run_pipeline


def _distill(prune_distill_config, out, *, global_seed):
    # width-pruned student (hidden 32 -> 16): a 16 -> 32 projection trains with it
    config = prune_distill_config(steps=4, eval_every=4, hidden_loss_weight=1.0)
    # what the process ran before leaves the global RNG anywhere; the run must not depend on it
    torch.manual_seed(global_seed)
    run_pipeline(config, out)
    lines = (out / "distill" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines if "loss" in json.loads(line)]
    return losses, load_file(out / "distill" / "model" / "model.safetensors")


def test_distill_with_hidden_loss_is_reproducible(prune_distill_config, tmp_path):
    # Two runs in one process, the global RNG left in different states: with the projection
    # drawn from the global RNG (unseeded) the losses differ from the first step on.
    first_losses, first = _distill(prune_distill_config, tmp_path / "a", global_seed=1)
    second_losses, second = _distill(prune_distill_config, tmp_path / "b", global_seed=2)
    assert len(first_losses) == 4
    assert second_losses == first_losses
    assert first.keys() == second.keys()
    for name, value in first.items():
        assert torch.equal(second[name], value), name
