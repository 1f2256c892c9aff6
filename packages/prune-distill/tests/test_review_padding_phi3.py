"""Review fixes: LM losses independent of the padding side, Phi-3 LongRoPE refusals, head_dim.

1. Every LM loss gives the unpadded sequences' value for left- and right-padded batches (a
   target predicted from a padding position is not scored).
2. A Phi-3 LongRoPE shape refused by transformers' `Phi3Config` check is explained as such, by
   `prune` and by `search`.
3. A config class without a `head_dim` field gets none when the pruned shape derives it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers as tf

from prune_distill import (
    DistillConfig,
    PruneTarget,
    SearchSpace,
    collect_importance,
    contiguous_block_search,
    correct_teacher,
    distill,
    prune,
    search,
    validation_loss,
)
from prune_distill.importance import lm_targets

VOCAB = 128
LENGTHS = (9, 6, 4)


def _rows() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(2, VOCAB, (n,), generator=gen) for n in LENGTHS]  # 0 is the pad id


def _padded(rows: list[torch.Tensor], side: str) -> dict[str, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, span], mask[i, span] = row, 1
    return {"input_ids": ids, "attention_mask": mask}


def _layouts() -> dict[str, list[dict[str, torch.Tensor]]]:
    """The same three sequences: one per batch (unpadded), or one right- / left-padded batch."""
    rows = _rows()
    return {
        "unpadded": [{"input_ids": r[None]} for r in rows],
        "right": [_padded(rows, "right")],
        "left": [_padded(rows, "left")],
    }


def _close(got: Any, expect: Any) -> None:
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(expect), rtol=1e-5, atol=2e-6)


def test_lm_targets_skip_targets_predicted_from_padding():
    batch = {
        "input_ids": torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 0, 0]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]]),
    }
    expect = torch.tensor([[-100, -100, 6, 7], [9, 10, -100, -100]])
    assert torch.equal(lm_targets(batch), expect)
    # with labels, the labels decide which tokens are targets (the label 4 of the padding token
    # at (1, 3) counts), and a target predicted from a padding position still does not
    labels = torch.tensor([[-100, 3, 5, 6, -100], [8, 9, -100, 4, 4]])
    assert torch.equal(
        lm_targets({**batch, "labels": labels}),
        torch.tensor([[-100, -100, 6, -100], [9, -100, 4, -100]]),
    )


def test_lm_losses_equal_unpadded_for_left_and_right_padding(make):
    model = make("llama")
    layouts = _layouts()
    ref = layouts.pop("unpadded")
    scores = collect_importance(model, ref, num_samples=None)
    block = contiguous_block_search(model, ref, 1)
    val = validation_loss(model, ref)
    for side, batches in layouts.items():
        got = collect_importance(model, batches, num_samples=None)
        assert got.lm_loss_increase is not None, side
        _close(got.lm_loss_increase, scores.lm_loss_increase)
        found = contiguous_block_search(model, batches, 1)
        _close(found.loss_increase, block.loss_increase)
        _close(found.base_loss, block.base_loss)
        _close(validation_loss(model, batches), val)


def _distill_logs(make: Any, batches: list[dict[str, torch.Tensor]]) -> list[float]:
    teacher = make("llama")
    student = make("llama", seed=1)
    cfg = DistillConfig(
        lm_loss_weight=0.5, lr=0.0, max_steps=1, grad_accumulation_steps=len(batches)
    )
    result = distill(student, teacher, batches, cfg)
    return [result.lm_loss[0], result.kl[0], result.losses[0]]


def test_distill_cross_entropy_equals_unpadded_for_left_and_right_padding(make):
    layouts = _layouts()
    ref = _distill_logs(make, layouts.pop("unpadded"))  # one micro-batch per sequence
    for batches in layouts.values():
        _close(_distill_logs(make, batches), ref)


def _corrected(model: Any, batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    fixed = correct_teacher(
        model,
        batches,
        steps=1,
        optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
        grad_accumulation_steps=len(batches),
        max_grad_norm=None,
    )
    return {k: v - model.state_dict()[k] for k, v in fixed.state_dict().items()}


def test_correct_teacher_step_equals_unpadded_for_left_and_right_padding(make):
    model = make("llama")
    layouts = _layouts()
    ref = _corrected(model, layouts.pop("unpadded"))  # the update: -lr x gradient
    assert max(float(d.abs().max()) for d in ref.values()) > 1e-3
    for batches in layouts.values():
        got = _corrected(model, batches)
        for name, step in ref.items():
            torch.testing.assert_close(got[name], step, rtol=1e-4, atol=1e-6, msg=name)


# --- Phi-3 with LongRoPE ----------------------------------------------------------------------


def _phi3_longrope() -> Any:
    """Phi-4-mini-like: head_dim 8 = 48 / 6, partial rotary 0.75: 6 rotary dims, 3 factors."""
    config = tf.Phi3Config(
        vocab_size=VOCAB,
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=72,
        num_hidden_layers=2,
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        partial_rotary_factor=0.75,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.1, 1.2],
            "long_factor": [1.5, 2.0, 3.0],
        },
        pad_token_id=None,
    )
    torch.manual_seed(0)
    return tf.Phi3ForCausalLM(config).eval()


LONGROPE_HINT = (
    "its LongRoPE `rope_parameters` short_factor / long_factor lists have 3 entries, one per "
    "rotary frequency of head_dim 8 (int(head_dim x partial_rotary_factor 0.75) // 2), but "
    "transformers' Phi3Config checks their length against hidden_size // num_attention_heads "
    "({hidden} // {heads} = {ratio}, which asks for {asks}), not head_dim: prune hidden_size "
    "and num_attention_heads together so that hidden_size / num_attention_heads stays 8, or "
    "prune only intermediate_size and num_hidden_layers"
)


@pytest.mark.parametrize(
    ("target", "hidden", "heads", "ratio", "asks"),
    [
        (PruneTarget(hidden_size=40), 40, 6, 6, 2),
        (PruneTarget(num_attention_heads=4, num_key_value_heads=2), 48, 4, 12, 4),
    ],
)
def test_phi3_longrope_refusal_names_the_cause(data, target, hidden, heads, ratio, asks):
    model = _phi3_longrope()
    scores = collect_importance(model, data())
    with pytest.raises(ValueError, match="LongRoPE") as err:
        prune(model, scores, target)
    shape = {
        "hidden_size": hidden,
        "intermediate_size": 72,
        "num_attention_heads": heads,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "head_dim": 8,
    }
    hint = LONGROPE_HINT.format(hidden=hidden, heads=heads, ratio=ratio, asks=asks)
    assert str(err.value) == f"Phi3Config rejects the pruned shape {shape}: {hint}"


def test_phi3_longrope_keeping_the_ratio_prunes_and_reloads(data, tmp_path):
    model = _phi3_longrope()
    student = prune(
        model, collect_importance(model, data()), PruneTarget(hidden_size=32, num_attention_heads=4)
    )
    assert (student.config.hidden_size, student.config.num_attention_heads) == (32, 4)
    assert "head_dim" not in student.config.to_dict()  # 32 / 4 = 8 derives it
    student.save_pretrained(tmp_path)
    reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = data(1, seed=1)[0]["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=ids).logits, student(input_ids=ids).logits, rtol=0, atol=0
        )


def test_search_reports_longrope_skips(data):
    model = _phi3_longrope()
    scores = collect_importance(model, data())
    space = SearchSpace(hidden_size=(40, 32))
    with pytest.raises(ValueError, match="LongRoPE") as err:
        search(model, scores, space, params=10**6, train_batches=data(1), val_batches=data(1))
    hint = LONGROPE_HINT.format(hidden=40, heads=6, ratio=6, asks=2)
    assert str(err.value) == (
        f"none of the 2 shapes of {space} can be pruned from this model; 2 of 2 skipped, most "
        f"often (2x) because Phi3Config rejects the shape: {hint}"
    )


# --- head_dim only where the config class needs it --------------------------------------------

_NO_HEAD_DIM = {
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
    "granite": (tf.GraniteConfig, tf.GraniteForCausalLM),
    "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
}


@pytest.mark.parametrize("family", sorted(_NO_HEAD_DIM))
def test_config_without_head_dim_gets_none_unless_needed(family, data, tmp_path):
    config_cls, model_cls = _NO_HEAD_DIM[family]
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        num_hidden_layers=2,
        max_position_embeddings=64,
        pad_token_id=None,
    )
    assert "head_dim" not in config.to_dict()
    torch.manual_seed(0)
    model = model_cls(config).eval()
    scores = collect_importance(model, data())
    noop = prune(model, scores, PruneTarget())
    assert noop.config.to_dict() == model.config.to_dict()
    kept = prune(model, scores, PruneTarget(hidden_size=16, num_attention_heads=2))
    assert "head_dim" not in kept.config.to_dict()  # 16 / 2 = 8 derives it
    narrow = prune(model, scores, PruneTarget(hidden_size=24))  # 24 / 4 != 8: stated
    assert narrow.config.to_dict()["head_dim"] == 8
    ids = data(1, seed=1)[0]["input_ids"]
    for i, student in enumerate((kept, narrow)):
        student.save_pretrained(tmp_path / str(i))
        reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / str(i)).eval()
        assert reloaded.config.to_dict().get("head_dim") == student.config.to_dict().get("head_dim")
        with torch.no_grad():
            torch.testing.assert_close(
                reloaded(input_ids=ids).logits, student(input_ids=ids).logits, rtol=0, atol=0
            )
