"""Drop-in use with the Hugging Face Trainer (tiny Llama built from a config: no download)."""

import pytest
import torch

from optim_came import CAME

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _dataset(vocab: int, n: int = 8, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=gen)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def _args(tmp_path) -> "transformers.TrainingArguments":
    return transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        warmup_steps=1,
        lr_scheduler_type="cosine",
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=1,
        disable_tqdm=True,
    )


@pytest.mark.parametrize("how", ["optimizers", "optimizer_cls_and_kwargs"])
def test_trainer_trains_with_came(how: str, tmp_path) -> None:
    from leanlm_testing.models import tiny_llama

    model = tiny_llama().train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    kwargs = {"lr": 1e-3, "weight_decay": 0.01}
    extra = {}
    if how == "optimizers":
        extra["optimizers"] = (CAME(model.parameters(), **kwargs), None)
    else:
        extra["optimizer_cls_and_kwargs"] = (CAME, kwargs)
    trainer = transformers.Trainer(
        model=model, args=_args(tmp_path), train_dataset=_dataset(model.config.vocab_size), **extra
    )
    result = trainer.train()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(opt, CAME)
    assert torch.isfinite(torch.tensor(result.training_loss))
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4
    # the Trainer's scheduler drives group["lr"]; the optimizer never writes it
    assert opt.param_groups[0]["lr"] < 1e-3
    assert opt.state[next(model.parameters())]["step"] == 4


RESUME_CONFIGS = {
    "fp32": ({"lr": 1e-3, "weight_decay": 0.01, "instability_init": 1.0}, torch.float32),
    # bf16 weights with stochastic rounding: the rounding generator is in the checkpoint
    "bf16_sr": ({"lr": 1e-3, "weight_decay": 0.01, "stochastic_rounding": True}, torch.bfloat16),
}


@pytest.mark.parametrize("config", list(RESUME_CONFIGS))
def test_trainer_checkpoint_resume_is_exact(config: str, tmp_path) -> None:
    """Save at step 3, stop, resume from the checkpoint: bit-equal to 6 uninterrupted steps."""
    from leanlm_testing.hf_trainer import check_trainer_resume_is_exact

    kwargs, dtype = RESUME_CONFIGS[config]
    _, resumed = check_trainer_resume_is_exact(
        lambda model: (CAME(model.parameters(), **kwargs), None), tmp_path, dtype=dtype
    )
    assert isinstance(resumed.optimizer, CAME)
    assert resumed.optimizer.param_groups[0]["lr"] < 1e-3  # the Trainer's cosine schedule
