"""The README's examples run as written, scaled to a tiny Llama, and do what they say.

Scaled: the hub path becomes a local `save_pretrained` folder, the target sizes and step
counts become a tiny model's (each replaced text must still be in the README).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from leanlm_testing.models import random_batches, tiny_llama
from leanlm_testing.readme import run_blocks

README = Path(__file__).resolve().parents[1] / "README.md"


def _batches(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    return random_batches(256, batches=n, batch_size=2, seq_len=16, seed=seed)


def test_quick_start_prunes_and_distills_a_local_model(tmp_path: Path, monkeypatch: Any) -> None:
    teacher = tiny_llama(num_hidden_layers=3)
    teacher.save_pretrained(tmp_path / "teacher")
    monkeypatch.chdir(tmp_path)  # the example saves "pruned-distilled"
    ns = run_blocks(
        README,
        [0],
        {"batches": _batches(2, 0), "train_batches": _batches(3, 1)},
        scale={
            '"path/to/model"': repr(str(tmp_path / "teacher")),
            "num_samples=1024": "num_samples=4",
            "hidden_size=3072": "hidden_size=48",
            "intermediate_size=9216": "intermediate_size=128",
            "num_attention_heads=24": "num_attention_heads=2",
            "num_hidden_layers=32": "num_hidden_layers=2",
            "max_steps=1000": "max_steps=3",
        },
    )
    student = ns["student"]
    config = student.config
    assert (config.hidden_size, config.intermediate_size) == (48, 128)
    assert (config.num_attention_heads, config.num_hidden_layers) == (2, 2)
    assert ns["result"].steps == 3
    assert all(torch.isfinite(torch.tensor(ns["result"].kl)))
    # the teacher is not modified; the saved folder is a plain HF checkpoint of the student
    reference = tiny_llama(num_hidden_layers=3)
    for name, value in reference.state_dict().items():
        assert torch.equal(ns["teacher"].state_dict()[name], value), name
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned-distilled")
    ids = _batches(1, 2)[0]["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=ids).logits, student.eval()(input_ids=ids).logits
        )


def test_depth_pruning_with_hidden_state_distillation() -> None:
    teacher = tiny_llama(num_hidden_layers=4).train()
    ns = run_blocks(
        README,
        [2],
        {"teacher": teacher, "batches": _batches(2, 0), "train_batches": _batches(2, 1)},
        scale={"steps=200": "steps=2", "num_hidden_layers=16": "num_hidden_layers=2"},
    )
    assert ns["student"].config.num_hidden_layers == 2
    layer_map = ns["cfg"].hidden_layer_map
    assert len(layer_map) == 2
    assert all(0 <= t < 4 for t in layer_map.values())
    assert len(ns["result"].hidden_loss) == 2  # one hidden-state loss per step
    assert all(torch.isfinite(torch.tensor(ns["result"].hidden_loss)))
