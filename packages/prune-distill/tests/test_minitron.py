"""Minitron options: aggregation ablation, ModelOpt head order, final norm, contiguous depth
blocks and the architecture search."""

from __future__ import annotations

import copy

import pytest
import torch

from prune_distill import (
    DistillConfig,
    PruneTarget,
    SearchSpace,
    collect_importance,
    contiguous_block_search,
    prune,
    search,
    validation_loss,
)
from prune_distill.search import candidates, count_params

SEQ = {
    "mean": lambda x, m: (x * m).sum(1) / m.sum(1),
    "l2": lambda x, m: (x * x * m).sum(1).sqrt(),
    "var": lambda x, m: (
        (((x - ((x * m).sum(1) / m.sum(1)).unsqueeze(1)) ** 2) * m).sum(1) / m.sum(1)
    ),
}
BATCH = {
    "l2": lambda r: r.pow(2).sum(0).sqrt(),
    "mean": lambda r: r.mean(0),
    "var": lambda r: r.var(0, unbiased=False),
}


@pytest.mark.parametrize("seq", ["mean", "l2", "var"])
@pytest.mark.parametrize("batch_agg", ["l2", "mean", "var"])
def test_aggregation_options_match_their_formulas(make, capture, seq, batch_agg):
    """Three samples, the last one partly padding (padding must not count anywhere)."""
    model = make("llama")
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 128, (3, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[2, 5:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    scores = collect_importance(
        model, [batch], layer_loss=False, seq_aggregation=seq, batch_aggregation=batch_agg
    )
    got = capture(model, batch)
    m = mask.double().unsqueeze(-1)

    def agg(x: torch.Tensor) -> torch.Tensor:
        return BATCH[batch_agg](SEQ[seq](x.double(), m)).float()

    for i in range(3):
        heads = got["o_in"][i].reshape(3, 9, 8, 6).norm(dim=-1)
        torch.testing.assert_close(scores.heads[i], agg(heads), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(
            scores.neurons[i], agg(got["down_in"][i].abs()), rtol=1e-4, atol=1e-6
        )
    hidden = sum(agg(o.abs()) for o in [*got["norms"], *got["final"]])
    torch.testing.assert_close(scores.hidden, hidden, rtol=1e-4, atol=1e-6)


def test_modelopt_head_order_and_final_norm_option(make, data, capture):
    model = make("llama")
    batch = data(1, batch_size=3, seq_len=7)[0]
    paper = collect_importance(model, [batch], layer_loss=False)
    mo = collect_importance(
        model, [batch], layer_loss=False, head_order="modelopt", final_norm=False
    )
    got = capture(model, batch)
    for i in range(3):
        x = got["o_in"][i].abs().double()  # (B, S, heads * head_dim)
        per_channel = x.mean(1).pow(2).sum(0).sqrt()  # channel first: seq mean, batch L2
        expect = per_channel.reshape(8, 6).norm(dim=-1).float()
        torch.testing.assert_close(mo.heads[i], expect, rtol=1e-4, atol=1e-6)
        assert not torch.allclose(mo.heads[i], paper.heads[i], rtol=1e-2)  # a different order
    layer_only = sum(o.abs().double().mean(1).pow(2).sum(0).sqrt() for o in got["norms"])
    torch.testing.assert_close(mo.hidden, layer_only.float(), rtol=1e-4, atol=1e-6)
    with_final = layer_only + got["final"][0].abs().double().mean(1).pow(2).sum(0).sqrt()
    torch.testing.assert_close(paper.hidden, with_final.float(), rtol=1e-4, atol=1e-6)


def test_bad_options_raise(make, data):
    model = make("llama")
    for kwargs, match in [
        ({"seq_aggregation": "max"}, "`seq_aggregation`"),
        ({"batch_aggregation": "sum"}, "`batch_aggregation`"),
        ({"head_order": "random"}, "`head_order`"),
    ]:
        with pytest.raises(ValueError, match=match):
            collect_importance(model, data(1), **kwargs)


# --- contiguous block ------------------------------------------------------------------------


@torch.no_grad()
def test_contiguous_block_search_finds_the_dead_block(make, data):
    model = make("qwen2", num_hidden_layers=5, layer_types=None)
    for i in (2, 3):  # layers 2 and 3 are the identity
        model.model.layers[i].self_attn.o_proj.weight.zero_()
        model.model.layers[i].mlp.down_proj.weight.zero_()
    # Labels = the full model's own greedy predictions (peaked logits): removing live layers
    # then raises the loss, while the dead block costs exactly nothing.
    model.lm_head.weight.mul_(4.0)
    calib = []
    for b in data(2):
        labels = b["input_ids"].clone()
        labels[:, 1:] = model(**b).logits[:, :-1].argmax(-1)
        calib.append({**b, "labels": labels})
    found = contiguous_block_search(model, calib, 2)
    assert found.loss_increase.shape == (4,)
    assert float(found.loss_increase[2]) == pytest.approx(0.0, abs=1e-6)
    assert torch.all(found.loss_increase[[0, 1, 3]] > 1e-4), found.loss_increase
    assert found.drop_layers == (2, 3)
    # Each entry equals the loss of the model with that block deleted.
    ids = data(2)[0]["input_ids"]
    for start in (0, 3):
        shallow = copy.deepcopy(model)
        del shallow.model.layers[start : start + 2]
        for j, layer in enumerate(shallow.model.layers):
            layer.self_attn.layer_idx = j
        shallow.config.num_hidden_layers = 3
        losses = [float(shallow(input_ids=c["input_ids"], labels=c["labels"]).loss) for c in calib]
        assert float(found.loss_increase[start]) == pytest.approx(
            sum(losses) / 2 - found.base_loss, abs=1e-4
        )
    student = prune(
        model, collect_importance(model, data(1)), PruneTarget(drop_layers=found.drop_layers)
    )
    torch.testing.assert_close(
        student(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="`num_drop`"):
        contiguous_block_search(model, data(1), 5)


# --- architecture search ----------------------------------------------------------------------


def test_candidates_counts_equal_the_pruned_models(make, data):
    model = make("llama")  # tied, head_dim 6, 8/2 heads
    space = SearchSpace(
        num_hidden_layers=(2, 3),
        hidden_size=(48, 64),
        intermediate_size=(48, 96),
        num_attention_heads=(4, 6, 8),
    )
    total = count_params(model)
    everything = candidates(model, space, params=total, tolerance=0.99)
    shapes = {(t.hidden_size, t.num_attention_heads) for t, _ in everything}
    assert (48, 6) in shapes  # 3 query heads in each of the 2 KV groups
    assert (64, 6) not in shapes  # LlamaConfig rejects hidden 64 with 6 heads
    scores = collect_importance(model, data(1), layer_loss=False)
    for target, n in everything[:4]:
        assert count_params(prune(model, scores, target)) == n
    budget = count_params(prune(model, scores, PruneTarget(num_hidden_layers=2)))
    near = candidates(model, space, params=budget, tolerance=0.05)
    assert near
    assert all(abs(n - budget) <= 0.05 * budget for _, n in near)


def test_search_ranks_by_distilled_validation_loss(make, data):
    teacher = make("llama", initializer_range=0.1)
    scores = collect_importance(teacher, data(2), layer_loss=False)
    space = SearchSpace(num_hidden_layers=(2, 3), intermediate_size=(48, 96))
    budget = count_params(prune(teacher, scores, PruneTarget(num_hidden_layers=2)))
    val = data(2, seed=7)
    result = search(
        teacher,
        scores,
        space,
        params=budget,
        tolerance=0.2,
        train_batches=data(6, batch_size=4, seed=3),
        val_batches=val,
        distill_config=DistillConfig(lr=1e-3),
    )
    losses = [c.loss_distilled for c in result.ranking]
    assert len(losses) >= 2
    assert losses == sorted(losses)
    assert all(abs(c.params - budget) <= 0.2 * budget for c in result.ranking)
    best = result.ranking[0]
    assert validation_loss(result.best, val) == pytest.approx(best.loss_distilled, rel=1e-6)
    assert count_params(result.best) == best.params
    assert any(c.loss_distilled < c.loss_pruned for c in result.ranking)
    assert "| 1 |" in result.table()
    with pytest.raises(ValueError, match="within"):
        search(teacher, scores, space, params=10, train_batches=[], val_batches=val)
