"""Drop-in use with the Hugging Face Trainer (tiny Llama built from a config: no download)."""

import pytest
import torch

from optim_came import CAME

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@pytest.mark.parametrize("how", ["optimizers", "optimizer_cls_and_kwargs"])
def test_trainer_trains_with_came(how: str, tmp_path) -> None:
    from leanlm_testing.hf_trainer import check_trainer_trains

    kwargs = {"lr": 1e-3, "weight_decay": 0.01}
    overrides = {"warmup_steps": 1, "lr_scheduler_type": "cosine"}
    run = check_trainer_trains(CAME, kwargs, how, tmp_path, args_overrides=overrides)
    opt = run.optimizer
    # the Trainer's scheduler drives group["lr"]; the optimizer never writes it
    assert opt.param_groups[0]["lr"] < 1e-3
    assert opt.state[next(run.model.parameters())]["step"] == 4


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
