"""The search budget's parameter counts, every family, tied and untied embeddings.

`prune_distill.search.candidates` predicts a pruned shape's size from the pruned config built on
the meta device. That prediction must equal `sum(p.numel())` of the model `prune` returns for
the same shape, and both must equal a closed-form count written here from the transformers
modeling code (independently of the adapters), so a config field the pruned config gets wrong
(KV heads, head_dim, a bias) shows up even where the meta model and the pruned model agree.
"""

from __future__ import annotations

from typing import Any

import pytest

from prune_distill import PruneTarget, SearchSpace, collect_importance, prune
from prune_distill.search import candidates, count_params


def closed_form(arch: str, src: Any, t: PruneTarget, *, tied: bool) -> int:
    """Parameters of `arch` pruned to `t`, from the source config `src` and the target alone."""
    V, H, F, L, h = (
        src.vocab_size,
        t.hidden_size,
        t.intermediate_size,
        t.num_hidden_layers,
        t.num_attention_heads,
    )
    assert None not in (H, F, L, h)
    lm_head = 0 if tied else V * H
    if arch in ("gpt2", "gpt_neox"):  # attention width = H; fused qkv; every Linear has a bias
        layer = (3 * H * H + 3 * H) + (H * H + H) + (H * F + F) + (F * H + H) + 2 * (2 * H)
        positions = src.n_positions * H if arch == "gpt2" else 0
        return V * H + positions + 2 * H + lm_head + L * layer  # + final LayerNorm (w, b)
    d = src.head_dim
    group = src.num_attention_heads // src.num_key_value_heads
    kv = h if group == 1 else src.num_key_value_heads  # MHA: KV heads follow the heads
    q, k = h * d, kv * d
    layer = H * q + 2 * H * k + q * H + 3 * H * F  # q, k, v, o; gate, up, down (Phi-3 fused)
    layer += (4 if arch in ("gemma2", "gemma3") else 2) * H  # RMSNorm weights
    if arch == "qwen2":  # q/k/v biases
        layer += q + 2 * k
    if arch in ("qwen3", "gemma3"):  # per-head q/k norms over head_dim
        layer += 2 * d
    if arch == "olmo2":  # q/k norms over the whole projections
        layer += q + k
    if getattr(src, "attention_bias", False) and arch != "qwen2":  # q, k, v and o biases
        layer += q + 2 * k + H
    if getattr(src, "mlp_bias", False):
        layer += 2 * F + H
    return V * H + H + lm_head + L * layer  # embedding, final norm, LM head


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_predicted_counts_equal_the_pruned_models(arch, tied, make, data, targets):
    model = make(arch, tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    src, t = model.config, targets[arch]
    full = PruneTarget(
        hidden_size=src.hidden_size,
        intermediate_size=src.n_inner if arch == "gpt2" else src.intermediate_size,
        num_attention_heads=src.num_attention_heads,
        num_hidden_layers=src.num_hidden_layers,
    )
    assert count_params(model) == closed_form(arch, src, full, tied=tied)
    # Two choices per axis (the family's test target and the model's own size): 16 shapes,
    # 8 for GPT-2 / GPT-NeoX, where hidden and heads come together.
    space = SearchSpace(
        num_hidden_layers=(t.num_hidden_layers, full.num_hidden_layers),
        hidden_size=(t.hidden_size, full.hidden_size),
        intermediate_size=(t.intermediate_size, full.intermediate_size),
        num_attention_heads=(t.num_attention_heads, full.num_attention_heads),
    )
    every = candidates(model, space, params=count_params(model), tolerance=1 - 1e-9)
    assert len(every) == (8 if arch in ("gpt2", "gpt_neox") else 16)
    scores = collect_importance(model, data(1), layer_loss=False)
    for target, predicted in every:
        assert predicted == closed_form(arch, src, target, tied=tied), target
        student = prune(model, scores, target)
        assert sum(p.numel() for p in student.parameters()) == predicted, target
        assert (student.lm_head.weight is student.get_input_embeddings().weight) == tied
    # The budget keeps exactly the shapes whose count is within params * (1 ± tolerance).
    budget = int(0.7 * count_params(model))
    kept = {tgt for tgt, _ in candidates(model, space, params=budget, tolerance=0.15)}
    expect = {tgt for tgt, n in every if abs(n - budget) <= 0.15 * budget}
    assert kept == expect
