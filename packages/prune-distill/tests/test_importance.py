"""Importance collection: the Minitron formulas on hand-checkable cases, and no side effects."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from prune_distill import ImportanceScores, collect_importance


def test_single_sequence_matches_formulas(make, data, capture):
    model = make("llama")
    ids = data(1, batch_size=1)[0]["input_ids"]
    scores = collect_importance(model, [{"input_ids": ids}])
    got = capture(model, {"input_ids": ids})
    assert scores.num_samples == 1
    assert scores.num_tokens == ids.numel()
    for i in range(3):
        # Heads: per-token L2 norm of each head's output, mean over the sequence.
        per_head = got["o_in"][i][0].reshape(ids.shape[1], 8, 6).norm(dim=-1).mean(0)
        torch.testing.assert_close(scores.heads[i], per_head)
        torch.testing.assert_close(scores.neurons[i], got["down_in"][i][0].abs().mean(0))
        cos = F.cosine_similarity(got["layer_in"][i][0], got["layer_out"][i][0], dim=-1)
        torch.testing.assert_close(scores.block_importance[i], 1 - cos.mean(), atol=1e-6, rtol=0)
    hidden = sum(o[0].abs().mean(0) for o in [*got["norms"], *got["final"]])
    torch.testing.assert_close(scores.hidden, hidden)


def test_batch_aggregation_is_l2_and_padding_is_ignored(make, data):
    model = make("mistral")
    a, b = data(2, batch_size=1, seq_len=10)
    sa = collect_importance(model, [a])
    sb = collect_importance(model, [b])
    # b padded on the right with junk: the mask must make the junk invisible (causal model).
    padded = torch.cat([b["input_ids"], torch.randint(0, 128, (1, 5))], dim=1)
    ids = torch.cat([torch.cat([a["input_ids"], torch.zeros(1, 5, dtype=torch.long)], 1), padded])
    mask = torch.ones_like(ids)
    mask[:, 10:] = 0
    both = collect_importance(model, [{"input_ids": ids, "attention_mask": mask}])
    assert both.num_samples == 2
    assert both.num_tokens == 20
    for name in ("heads", "neurons"):
        expect = (getattr(sa, name) ** 2 + getattr(sb, name) ** 2).sqrt()
        torch.testing.assert_close(getattr(both, name), expect, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(
        both.block_importance, (sa.block_importance + sb.block_importance) / 2, rtol=1e-4, atol=1e-6
    )
    assert both.lm_loss_increase is not None
    assert sa.lm_loss_increase is not None
    assert sb.lm_loss_increase is not None
    torch.testing.assert_close(
        both.lm_loss_increase,
        (sa.lm_loss_increase + sb.lm_loss_increase) / 2,
        rtol=1e-4,
        atol=1e-6,
    )


def test_lm_loss_increase_matches_manual_layer_removal(make, data):
    model = make("qwen2")
    batch = data(1)[0]
    scores = collect_importance(model, [batch])
    ids = batch["input_ids"]

    def loss(m: Any) -> float:
        with torch.no_grad():
            return float(m(input_ids=ids, labels=ids, use_cache=False).loss)

    base = loss(model)
    import copy

    for i in range(3):
        shallow = copy.deepcopy(model)
        del shallow.model.layers[i]
        shallow.config.num_hidden_layers = 2
        assert scores.lm_loss_increase is not None
        assert abs(float(scores.lm_loss_increase[i]) - (loss(shallow) - base)) < 1e-4


def test_num_samples_truncates(make, data):
    model = make("gpt2")
    batches = data(3, batch_size=2)
    some = collect_importance(model, batches, num_samples=3, layer_loss=False)
    assert some.num_samples == 3
    assert some.lm_loss_increase is None
    manual = collect_importance(
        model, [batches[0], {"input_ids": batches[1]["input_ids"][:1]}], layer_loss=False
    )
    torch.testing.assert_close(some.neurons, manual.neurons)
    torch.testing.assert_close(some.hidden, manual.hidden)


def test_model_left_unchanged(arch, make, data):
    model = make(arch).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    collect_importance(model, data())
    assert model.training
    for m in model.modules():
        assert not m._forward_hooks
        assert not m._forward_pre_hooks
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_scores_save_load_roundtrip(make, data, tmp_path):
    scores = collect_importance(make("llama"), data())
    scores.save(tmp_path / "scores.pt")
    loaded = ImportanceScores.load(tmp_path / "scores.pt")
    assert loaded.num_tokens == scores.num_tokens
    torch.testing.assert_close(loaded.heads, scores.heads)
    assert loaded.lm_loss_increase is not None
