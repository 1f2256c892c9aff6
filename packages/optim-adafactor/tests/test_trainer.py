"""Drop-in use with the Hugging Face Trainer (tiny Llama built from a config: no download)."""

import pytest
import torch

from optim_adafactor import Adafactor

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@pytest.mark.parametrize("how", ["optimizers", "optimizer_cls_and_kwargs"])
def test_trainer_trains_with_adafactor(how: str, tmp_path) -> None:
    from leanlm_testing.hf_trainer import check_trainer_trains

    kwargs = {"lr": 1e-3, "relative_step": False, "scale_parameter": False, "beta1": 0.9}
    check_trainer_trains(Adafactor, kwargs, how, tmp_path)


RESUME_CONFIGS = {
    # the Trainer's own (cosine) schedule drives group["lr"]; momentum and weight decay
    "external_lr": ({"lr": 1e-3, "relative_step": False, "beta1": 0.9, "weight_decay": 0.01}, {}),
    # HF's recipe for lr=None: relative step, proxied to the Trainer by AdafactorSchedule
    "adafactor_schedule": ({"beta1": 0.9}, {"schedule": True}),
    # bf16 weights with stochastic rounding: the rounding generator is in the checkpoint
    "bf16_sr": (
        {"lr": 1e-3, "relative_step": False, "stochastic_rounding": True},
        {"dtype": torch.bfloat16},
    ),
}


@pytest.mark.parametrize("config", list(RESUME_CONFIGS))
def test_trainer_checkpoint_resume_is_exact(config: str, tmp_path) -> None:
    """Save at step 3, stop, resume from the checkpoint: bit-equal to 6 uninterrupted steps."""
    from transformers.optimization import AdafactorSchedule

    from leanlm_testing.hf_trainer import check_trainer_resume_is_exact

    kwargs, how = RESUME_CONFIGS[config]

    def make(model):
        opt = Adafactor(model.parameters(), **kwargs)
        return opt, AdafactorSchedule(opt) if how.get("schedule") else None

    straight, resumed = check_trainer_resume_is_exact(
        make, tmp_path, dtype=how.get("dtype", torch.float32)
    )
    assert isinstance(resumed.optimizer, Adafactor)
    if how.get("schedule"):  # the proxy reports the step size of the last step
        opt = straight.optimizer
        first = straight.model.get_parameter("model.embed_tokens.weight")
        last_lr = straight.trainer.lr_scheduler.get_last_lr()[0]
        assert last_lr == opt._get_lr(opt.param_groups[0], opt.state[first])
        assert 0 < last_lr < 1e-2
