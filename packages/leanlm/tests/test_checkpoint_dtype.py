"""Models load in their checkpoint's dtype: a bf16 `init_model` is scored and taught in bf16.

Only what trains is upcast to fp32 (the engines keep fp32 parameters under autocast).
"""

import torch
from safetensors import safe_open

from leanlm.run.pipeline import run_pipeline
from leanlm.train.model import TRAIN_DTYPE, load_model, load_teacher
from leanlm_testing.models import tiny_llama


def _stored_dtypes(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {f.get_slice(key).get_dtype() for key in f.keys()}  # noqa: SIM118


def test_a_bf16_checkpoint_loads_in_bf16_and_reloads_exactly(tmp_path):
    model = tiny_llama(seed=3).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))

    loaded = load_model(tmp_path / "bf16")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    for (name, p), q in zip(loaded.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name
    # (not the bf16-cast original's logits: `.to(bf16)` also rounds its rotary `inv_freq`
    # buffer, which a loaded model recomputes in fp32)
    expected = loaded(input_ids=ids).logits
    loaded.save_pretrained(tmp_path / "again")
    assert _stored_dtypes(tmp_path / "again") == {"BF16"}
    assert torch.equal(load_model(tmp_path / "again")(input_ids=ids).logits, expected)

    teacher = load_teacher(tmp_path / "bf16")
    assert not teacher.training
    assert {(p.dtype, p.requires_grad) for p in teacher.parameters()} == {(torch.bfloat16, False)}

    trainable = load_model(tmp_path / "bf16", dtype=TRAIN_DTYPE)
    for (name, p), q in zip(trainable.named_parameters(), model.parameters(), strict=True):
        assert p.dtype == torch.float32, name
        assert p.requires_grad, name
        assert torch.equal(p, q.float()), name  # upcast exactly, not re-initialised


def test_prune_keeps_bf16_and_distill_trains_fp32_from_a_bf16_teacher(
    tiny_pretrained, prune_distill_config, tmp_path, monkeypatch
):
    config = prune_distill_config(tiny_pretrained.bf16)
    import leanlm.train.distill as distill_train

    seen = {}
    original = distill_train.distillation_loss

    def spy(teacher, cfg):
        seen["teacher"] = {(p.dtype, p.requires_grad) for p in teacher.parameters()}
        seen["teacher_training"] = teacher.training
        return original(teacher, cfg)

    monkeypatch.setattr(distill_train, "distillation_loss", spy)
    run_pipeline(config, tmp_path / "run")
    assert seen == {"teacher": {(torch.bfloat16, False)}, "teacher_training": False}
    # the pruned model is saved in the checkpoint's dtype, the distilled one in fp32 (trained)
    assert _stored_dtypes(tmp_path / "run" / "prune" / "model") == {"BF16"}
    assert _stored_dtypes(tmp_path / "run" / "distill" / "model") == {"F32"}
