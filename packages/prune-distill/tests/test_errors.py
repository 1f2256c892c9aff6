"""Unsupported models and impossible targets fail early with messages naming the field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prune_distill import PruneTarget, SearchSpace, collect_importance, prune, search
from prune_distill.search import count_params


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
        ({"drop_layers": 1}, TypeError, r"`drop_layers` \(1\) must be a tuple or list"),
        ({"drop_layers": "01"}, TypeError, r"`drop_layers` \('01'\) must be a tuple or list"),
        ({"drop_layers": ("0",)}, ValueError, r"`drop_layers` \(\('0',\)\) must hold distinct"),
        ({"drop_layers": (1, 1)}, ValueError, r"`drop_layers` \(\(1, 1\)\) must hold distinct"),
        ({"drop_layers": [-1]}, ValueError, r"`drop_layers` \(\[-1\]\) must hold distinct non-neg"),
        ({"drop_layers": (True,)}, ValueError, r"`drop_layers` \(\(True,\)\) must hold"),
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
    # the suggestion keeps the sizes asked for, not the unpruned 4 heads / 64 channels
    with pytest.raises(ValueError, match=r"e\.g\. num_attention_heads=3, hidden_size=48$"):
        prune(model, scores, PruneTarget(num_attention_heads=3))
    with pytest.raises(ValueError, match=r"e\.g\. num_attention_heads=2, hidden_size=32$"):
        prune(model, scores, PruneTarget(hidden_size=32))
    both = r"e\.g\. num_attention_heads=3, hidden_size=48 or num_attention_heads=2, hidden_size=32$"
    with pytest.raises(ValueError, match=both):
        prune(model, scores, PruneTarget(num_attention_heads=3, hidden_size=32))


def test_search_says_why_every_shape_was_skipped(make, data):
    model = make("gpt2")  # 4 heads of 16: hidden_size 48 needs 3 heads
    scores = collect_importance(model, data(1), layer_loss=False)
    n = count_params(model)
    kw = {"train_batches": data(1), "val_batches": data(1)}
    with pytest.raises(ValueError, match="none of the 2 shapes") as info:
        search(model, scores, SearchSpace(hidden_size=(48, 32)), params=n, tolerance=0.99, **kw)
    assert str(info.value).startswith("none of the 2 shapes of SearchSpace(")
    assert "; 2 of 2 skipped, most often (2x) because `hidden_size` (48) != " in str(info.value)
    assert "`num_attention_heads` (4) x head_dim (16), which gpt2 needs" in str(info.value)
    # some shapes counted, none within the budget: their range, then the skipped ones
    space = SearchSpace(hidden_size=(64, 48), num_hidden_layers=(1,))
    with pytest.raises(ValueError, match=r"has 10 parameters within ±5%: the 1 prunable shapes ha"):
        search(model, scores, space, params=10, **kw)
    with pytest.raises(ValueError, match=r"; 1 of 2 skipped, most often \(1x\) because `hidden_s"):
        search(model, scores, space, params=10, **kw)
    with pytest.raises(ValueError, match=r"`intermediate_size` \(999\) > the model's 96"):
        search(model, scores, SearchSpace(intermediate_size=(999,)), params=n, **kw)


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


def test_one_batch_or_a_used_up_iterator_is_refused(make, data):
    """Before: one batch dict failed with "'str' object has no attribute 'get'" (its keys were
    iterated), `search` given an iterator distilled the first candidate only (steps [6, 0, 0],
    the ranking wrong), and `distill` on no batch returned silently."""
    from prune_distill import contiguous_block_search, distill, evaluate_kl

    model, student = make("llama"), make("llama", seed=1)
    one = data(1)[0]
    for call in (
        lambda: collect_importance(model, one),
        lambda: contiguous_block_search(model, one, 1),
        lambda: distill(student, model, one),
        lambda: evaluate_kl(student, model, one),
    ):
        with pytest.raises(TypeError, match=r"`batches` must be an iterable .* \['input_ids'\]"):
            call()
    with pytest.raises(ValueError, match="`batches` yielded no batch"):
        distill(student, model, iter([]))
    scores = collect_importance(model, data(1))
    space = SearchSpace(intermediate_size=(64, 48))
    n = count_params(model)
    for kwargs in (
        {"train_batches": iter(data(2)), "val_batches": data(1)},
        {"train_batches": data(2), "val_batches": (b for b in data(1))},
    ):
        name = next(k for k, v in kwargs.items() if not isinstance(v, list))
        with pytest.raises(TypeError, match=f"`{name}` is an iterator"):
            search(model, scores, space, params=n, tolerance=0.9, **kwargs)


def test_numpy_scalars_are_accepted_as_numbers():
    import numpy as np

    from prune_distill import DistillConfig

    assert PruneTarget(hidden_size=np.int64(40)).hidden_size == 40
    assert type(PruneTarget(hidden_size=np.int64(40)).hidden_size) is int
    assert DistillConfig(loss="jsd", beta=np.float32(0.5)).beta == 0.5
