"""`leanlm plan`'s scoring passes: the calibration-batch extrapolation and the input dtypes."""

import dataclasses

import torch
from transformers import LlamaConfig

from leanlm.config import DataConfig, DistillConfig, PruneConfig, RunConfig, SparsifyConfig
from leanlm.plan_scoring import _one_shot, input_dtype, sparsify_phases
from leanlm.plan_tracking import fake_tensors
from leanlm_testing.models import tiny_llama_config

TINY = tiny_llama_config()


def test_the_sequential_pass_is_linear_in_its_calibration_batches():
    # 6 batches of 2 and a short 7th of 1: planned from 2 and 3 batches, each phase exactly as
    # the pass with 7 full batches (the short one is planned full)
    sparsify = SparsifyConfig(
        method="sparsegpt", calibration_samples=13, calibration_batch_size=2, eval_batch_size=2
    )
    run = RunConfig(data=DataConfig(seq_len=16, eval_windows=8), sparsify=sparsify)
    with fake_tensors():
        planned = sparsify_phases(run, TINY, torch.bfloat16)
        full = _one_shot(run, TINY, torch.bfloat16, [2] * 7)
        two = _one_shot(run, TINY, torch.bfloat16, [2] * 2)
    assert planned == full
    # each batch holds at least its bf16 hidden states in the scoring pass
    hidden = 2 * 16 * TINY.hidden_size * 2
    assert full["scoring"]["total"] - two["scoring"]["total"] >= 5 * hidden


def test_each_stage_loads_the_dtype_the_stage_before_saved():
    bf16 = LlamaConfig(dtype="bfloat16")
    steps = RunConfig(
        stages=("prune", "sparsify", "distill"),
        init_model="folder",
        distill=DistillConfig(teacher_stage="init"),
    )
    assert input_dtype(steps, "prune", bf16) == torch.bfloat16  # the checkpoint's
    assert input_dtype(steps, "sparsify", bf16) == torch.bfloat16  # pruned, saved as loaded
    assert input_dtype(steps, "distill", bf16) == torch.float32  # a sparse fine-tune: fp32
    one_shot = dataclasses.replace(steps, sparsify=SparsifyConfig(steps=0))
    assert input_dtype(one_shot, "distill", bf16) == torch.bfloat16
    searched = PruneConfig(search=True, search_params=10**6, search_hidden_size=(16, 32))
    search = dataclasses.replace(steps, prune=searched)
    assert input_dtype(search, "sparsify", bf16) == torch.float32
    trained = RunConfig(stages=("pretrain", "prune", "sparsify"))
    assert input_dtype(trained, "sparsify", LlamaConfig()) == torch.float32
