"""Unsupported models and impossible targets fail early with messages naming the field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prune_distill import PruneTarget, collect_importance, prune


@pytest.fixture(scope="module")
def llama_and_scores(make, data):
    model = make("llama")
    return model, collect_importance(model, data(1))


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (PruneTarget(hidden_size=80), r"`hidden_size` \(80\) must be between 1 and .* \(64\)"),
        (PruneTarget(num_hidden_layers=4), r"`num_hidden_layers` \(4\)"),
        (PruneTarget(num_key_value_heads=3), r"`num_key_value_heads` \(3\)"),
        (PruneTarget(num_attention_heads=3), r"`num_attention_heads` \(3\) must be a multiple"),
        (PruneTarget(num_attention_heads=6), r"LlamaConfig rejects .* not a multiple"),
        (
            PruneTarget(num_attention_heads=8, num_key_value_heads=1),
            r"8 query heads per KV group\) must be <= the model's 4",
        ),
        (PruneTarget(hidden_size=60), r"rejects the pruned shape .*hidden_size"),
        (PruneTarget(drop_layers=(0, 7)), r"`drop_layers` \(\(0, 7\)\)"),
        (PruneTarget(drop_layers=(0, 1, 2)), r"would drop all 3 layers"),
        (PruneTarget(drop_layers=(0,), num_hidden_layers=1), r"disagrees with `drop_layers`"),
    ],
)
def test_bad_targets(llama_and_scores, target, match):
    model, scores = llama_and_scores
    with pytest.raises(ValueError, match=match):
        prune(model, scores, target)


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"intermediate_size": 0}, ValueError, r"`intermediate_size` \(0\) must be a size >= 1"),
        ({"hidden_size": -64}, ValueError, r"`hidden_size` \(-64\) must be a size >= 1"),
        ({"num_hidden_layers": 2.0}, TypeError, r"`num_hidden_layers` must be an int or None"),
        ({"num_attention_heads": True}, TypeError, r"`num_attention_heads` must be an int"),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 4},
            ValueError,
            r"`num_key_value_heads` \(4\) must divide `num_attention_heads` \(6\)",
        ),
        ({"layer_metric": "random"}, ValueError, r"`layer_metric` \('random'\) must be"),
    ],
)
def test_targets_are_checked_when_built(fields, error, match):
    with pytest.raises(error, match=match):
        PruneTarget(**fields)


def test_lm_loss_metric_needs_loss_scores(llama_and_scores):
    model, scores = llama_and_scores
    scores = dataclasses.replace(scores, lm_loss_increase=None)
    with pytest.raises(ValueError, match="layer_loss=True"):
        prune(model, scores, PruneTarget(num_hidden_layers=2, layer_metric="lm_loss"))


def test_scores_of_another_model(llama_and_scores, make, data):
    _, scores = llama_and_scores
    other = make("llama", intermediate_size=80)
    with pytest.raises(ValueError, match=r"`scores.neurons` has shape \(3, 96\)"):
        prune(other, scores, PruneTarget())


def test_gpt2_constraints(make, data):
    model = make("gpt2")
    scores = collect_importance(model, data(1), layer_loss=False)
    with pytest.raises(ValueError, match=r"`hidden_size` \(48\) must equal .* \(4\) x head_dim"):
        prune(model, scores, PruneTarget(hidden_size=48))
    with pytest.raises(ValueError, match="`num_key_value_heads`"):
        prune(model, scores, PruneTarget(num_key_value_heads=2))


def test_unsupported_architecture():
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(
        OPTConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=1,
            ffn_dim=64,
            num_attention_heads=2,
            word_embed_proj_dim=32,
        )
    )
    with pytest.raises(ValueError, match=r"unsupported architecture: .*'opt'.*supported: "):
        collect_importance(model, [{"input_ids": torch.zeros(1, 4, dtype=torch.long)}])


def test_backbone_without_lm_head(make):
    with pytest.raises(ValueError, match="has no `lm_head`"):
        collect_importance(
            make("llama").model, [{"input_ids": torch.zeros(1, 4, dtype=torch.long)}]
        )


def test_batches_must_have_input_ids(make):
    with pytest.raises(ValueError, match="`input_ids`"):
        collect_importance(make("llama"), [{"x": torch.zeros(1, 4)}])
    with pytest.raises(ValueError, match="no sequences"):
        collect_importance(make("llama"), [])
