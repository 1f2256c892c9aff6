"""The sparsify stage loads its input in the checkpoint's dtype: a bf16 model is scored in bf16
(sparse-kernels' statistics in fp32) and a one-shot model is saved in bf16."""

import dataclasses

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from leanlm.config import SparsifyConfig
from leanlm.run.pipeline import run_pipeline
from leanlm.train.model import load_model
from sparse_kernels import load_masks_, masks


def _stored_dtypes(folder):
    return {t.dtype for t in load_file(folder / "model.safetensors").values()}


def _one_shot(config, init_model, out, method, steps=0):
    sparsify = SparsifyConfig(
        method=method,
        calibration_samples=8,
        calibration_batch_size=4,
        eval_batch_size=4,
        steps=steps,
        micro_batch_size=4,
        warmup_steps=0,
        checkpoint_every=0,
    )
    run = dataclasses.replace(
        config, init_model=str(init_model), stages=("sparsify",), sparsify=sparsify
    )
    run_pipeline(run, out)
    model = load_model(out / "sparsify" / "model")
    load_masks_(model, out / "sparsify" / "model")
    return model


def test_a_bf16_model_stays_bf16_and_gets_the_fp32_loaded_models_masks(tiny_pretrained, tmp_path):
    # the same weights as an fp32 folder: what the stage loaded before (`dtype=float32`)
    fp32 = tmp_path / "fp32"
    load_model(tiny_pretrained.bf16, dtype=torch.float32).save_pretrained(fp32)
    AutoTokenizer.from_pretrained(tiny_pretrained.bf16).save_pretrained(fp32)
    config = tiny_pretrained.config
    for method in ("magnitude", "wanda"):
        bf16_run = _one_shot(config, tiny_pretrained.bf16, tmp_path / f"bf16-{method}", method)
        fp32_run = _one_shot(config, fp32, tmp_path / f"fp32-{method}", method)
        stored = _stored_dtypes(tmp_path / f"bf16-{method}" / "sparsify" / "model")
        assert stored == {torch.bfloat16}
        assert {p.dtype for p in bf16_run.parameters()} == {torch.bfloat16}
        ours, theirs = masks(bf16_run), masks(fp32_run)
        assert len(ours) == 14
        assert ours.keys() == theirs.keys()
        for name, mask in ours.items():
            assert mask.float().mean() == 0.5, name  # 2:4
            agree = mask == theirs[name]  # the same bf16 values (fp32 run: exactly upcast)
            weight, other = (run.get_submodule(name).weight for run in (bf16_run, fp32_run))
            assert torch.equal(weight[agree], other.bfloat16()[agree]), name
        differ = {name: (mask != theirs[name]).float().mean().item() for name, mask in ours.items()}
        if method == "magnitude":  # |W|: the same values in either dtype
            assert set(differ.values()) == {0.0}
        else:
            # Wanda's statistics are fp32 sums either way, but of the activations the model
            # computes: the bf16 model rounds each norm's output to bf16 (relative 2^-9), so a
            # near-tie inside a group of 4 can swap (measured: at most 0.4% of a Linear's entries)
            assert max(differ.values()) <= 0.01, differ
    # with a fine-tune: the same masks (scored in bf16), then trained and saved in fp32
    tuned = _one_shot(config, tiny_pretrained.bf16, tmp_path / "tuned", "wanda", steps=1)
    assert _stored_dtypes(tmp_path / "tuned" / "sparsify" / "model") == {torch.float32}
    for name, mask in masks(tuned).items():
        assert torch.equal(mask, ours[name]), name
        assert not tuned.get_submodule(name).weight[~mask].any(), name
