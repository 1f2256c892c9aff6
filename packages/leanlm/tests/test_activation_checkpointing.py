"""`activation_checkpointing = true`: each decoder layer is recomputed in the backward, and
training is the same as without it."""

import dataclasses
import json

import pytest
import torch

from leanlm.config import dumps_toml
from leanlm.run.pipeline import run_pipeline
from leanlm.train.distill import StudentWithHiddenLoss
from leanlm.train.model import enable_activation_checkpointing
from leanlm_testing.cli_runs import run_leanlm
from leanlm_testing.models import tiny_llama
from prune_distill import HiddenStateLoss


def _saved_bytes_and_grads(model, ids, *, checkpointed):
    """Bytes autograd keeps for the backward (outside checkpoints), and the gradients."""
    if checkpointed:
        enable_activation_checkpointing(model)
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(input_ids=ids)
    logits = out.logits if hasattr(out, "logits") else out[0]
    logits.float().logsumexp(-1).mean().backward()
    return sum(saved), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("wrapped", [False, True], ids=["model", "student-with-hidden-loss"])
def test_layers_are_recomputed_and_gradients_unchanged(wrapped):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))

    def make():
        model = tiny_llama(seed=2)
        if wrapped:
            teacher = tiny_llama(seed=3)
            model = StudentWithHiddenLoss(model, HiddenStateLoss.between(model, teacher, seed=0))
        return model

    plain_bytes, plain = _saved_bytes_and_grads(make(), ids, checkpointed=False)
    ckpt_bytes, ckpt = _saved_bytes_and_grads(make(), ids, checkpointed=True)
    # the decoder layers' intermediates are not kept (recomputed in the backward)
    assert ckpt_bytes < 0.3 * plain_bytes, (ckpt_bytes, plain_bytes)
    assert plain.keys() == ckpt.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(ckpt[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_activation_checkpointing_needs_a_transformers_model():
    with pytest.raises(TypeError, match="`activation_checkpointing` needs a transformers model"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))


def _losses(out):
    rows = [
        json.loads(line) for line in (out / "pretrain" / "metrics.jsonl").read_text().splitlines()
    ]
    return [row["loss"] for row in rows if "loss" in row]


def test_a_stage_trains_the_same_with_activation_checkpointing(tmp_path, tiny_config, monkeypatch):
    import leanlm.train.model

    enabled = []

    def spy(model):
        enable_activation_checkpointing(model)
        enabled.append(model.model.layers[0].gradient_checkpointing)

    monkeypatch.setattr(leanlm.train.model, "enable_activation_checkpointing", spy)
    changes = {"steps": 4, "warmup_steps": 1, "checkpoint_every": 0, "eval_every": 4}
    base = tiny_config(pretrain=changes)
    ckpt = dataclasses.replace(
        base, pretrain=dataclasses.replace(base.pretrain, activation_checkpointing=True)
    )
    run_pipeline(base, tmp_path / "plain")
    assert enabled == []
    run_pipeline(ckpt, tmp_path / "ckpt")
    assert enabled == [True]
    plain, checkpointed = _losses(tmp_path / "plain"), _losses(tmp_path / "ckpt")
    assert len(plain) == 4
    torch.testing.assert_close(checkpointed, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "engine",
    [{"engine": "fsdp2"}, pytest.param({"zero_stage": 3}, marks=pytest.mark.slow)],
    ids=["fsdp2", "zero3"],
)
def test_activation_checkpointing_under_a_sharding_engine(tmp_path, tiny_config, engine):
    # 2 processes x 4 sequences with the layers recomputed inside the engine's gathers, against
    # 1 process x 4 x 2 micro-batches without checkpointing
    common = {"steps": 4, "warmup_steps": 1, "checkpoint_every": 0, "eval_every": 4}
    one = tiny_config(pretrain={**common, "grad_accum_steps": 2})
    two = tiny_config(pretrain={**common, **engine, "activation_checkpointing": True})
    run_pipeline(one, tmp_path / "one")
    (tmp_path / "two.toml").write_text(dumps_toml(two))
    done = run_leanlm("run", tmp_path / "two.toml", "--out", tmp_path / "two", "--processes", 2)
    assert done.returncode == 0, done.stderr[-3000:]
    torch.testing.assert_close(
        _losses(tmp_path / "two"), _losses(tmp_path / "one"), atol=1e-5, rtol=1e-5
    )


def test_checkpointed_bf16_layers_keep_no_weight_copies_and_train_the_same():
    """Autocast's cache would keep every layer's bf16 weight copy until the forward ends,
    though a checkpointed layer saves none of them for its backward (it casts again)."""
    from leanlm.plan_tracking import build, fake_tensors, measure
    from leanlm_testing.models import tiny_llama_config

    layers, hidden, ffn = 8, 256, 1024
    cfg = tiny_llama_config(
        vocab_size=64, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers
    )
    layer_bf16 = 2 * (hidden * hidden * 3 + 3 * hidden * ffn)  # q, o, k+v at GQA 4/2; the MLP
    with fake_tensors():
        model = build(cfg, torch.float32)
        enable_activation_checkpointing(model)
        model.train()

        def step(tracker):
            tracker.phase = "forward"
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=torch.randint(0, 64, (1, 8))).logits.float().mean()
            tracker.phase = "backward"
            loss.backward()

        peaks = measure(step, [model])
    held = peaks["forward"]["activations"]  # casts, saved layer inputs, temporaries
    assert held < 2 * layer_bf16, (held, layer_bf16)  # one weight's copy at a time, not 8 layers'
    assert held > 2 * hidden * hidden  # it did measure the casts (one q_proj copy at least)

    # and the gradients are those of the same bf16 forward without checkpointing
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = []
    for checkpointed in (False, True):
        model = tiny_llama(seed=2)
        if checkpointed:
            enable_activation_checkpointing(model)
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name
