"""`compile = true`: each decoder layer's forward goes through `torch.compile` (inductor on the
CPU), and training follows the eager run within float rounding, on one process and on two with
each engine (DDP, ZeRO, FSDP2). Compiling is slow on a CPU (~30 s per process for the tiny
model, less once inductor's cache holds the graph): the runs are a few steps."""

import json

import pytest
import torch
from safetensors.torch import load_file

from leanlm.config import TrainConfig
from leanlm.run.pipeline import run_pipeline

# dynamo reads `.grad` of non-leaf tensors while it builds its guards (a warning of torch's own)
pytestmark = pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"
)

STEPS = {"steps": 4, "warmup_steps": 1, "eval_every": 4, "checkpoint_every": 0}


def _losses(run_dir):
    rows = (run_dir / "pretrain" / "metrics.jsonl").read_text().splitlines()
    return torch.tensor([json.loads(r)["loss"] for r in rows if '"loss"' in r], dtype=torch.float64)


def _weights(run_dir):
    return load_file(run_dir / "pretrain" / "model" / "model.safetensors")


def test_compiled_training_follows_eager(tmp_path, tiny_config):
    from torch._dynamo.utils import counters

    eager = run_pipeline(tiny_config(pretrain=STEPS), tmp_path / "eager")[0]
    counters.clear()
    compiled = run_pipeline(tiny_config(pretrain={**STEPS, "compile": True}), tmp_path / "comp")[0]
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo compiled the layers
    # inductor fuses and reorders fp32 arithmetic: each step's loss moves by ~1e-7 relative
    losses = _losses(tmp_path / "comp")
    assert len(losses) == STEPS["steps"]
    torch.testing.assert_close(losses, _losses(tmp_path / "eager"), atol=1e-5, rtol=1e-5)
    a, b = _weights(tmp_path / "eager"), _weights(tmp_path / "comp")
    assert a.keys() == b.keys()  # parameter names untouched by compiling
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=2e-5, rtol=1e-4, msg=name)
    assert compiled.metrics["val_loss"] == pytest.approx(eager.metrics["val_loss"], rel=1e-5)


def test_compile_is_a_key_of_every_training_stage():
    from leanlm.config import RunConfig, from_dict

    config = from_dict(RunConfig, {name: {"compile": True} for name in ("pretrain", "distill")})
    assert config.pretrain.compile
    assert config.distill.compile
    assert not TrainConfig().compile


def test_checkpointed_layers_compile_under_bf16_autocast():
    """`compile = true` with activation checkpointing: the uncached casts stay outside the
    compiled forward (a checkpoint `context_fn` there is refused by torch.compile)."""
    from leanlm.train.engines import compile_layers
    from leanlm.train.model import enable_activation_checkpointing
    from leanlm_testing.models import tiny_llama

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    for compiled in (False, True):
        model = tiny_llama(seed=2).train()
        enable_activation_checkpointing(model)
        if compiled:
            assert compile_layers(model) == 2
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(model.model.layers[0].mlp.up_proj.weight.grad)
    # inductor fuses the bf16 ops differently: bf16-level agreement
    torch.testing.assert_close(losses[1], losses[0], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-3, rtol=1e-2)
