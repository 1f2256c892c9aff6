"""Pruning: exactness of the bookkeeping, reload equivalence, configs and parameter counts."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from prune_distill import PruneTarget, collect_importance, prune

# A width + depth target every test architecture accepts (GPT-2: hidden = heads x head_dim 16).
TARGETS = {
    "llama": PruneTarget(
        hidden_size=48, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2
    ),
    "mistral": PruneTarget(
        hidden_size=40,
        intermediate_size=50,
        num_attention_heads=4,
        num_key_value_heads=1,
        num_hidden_layers=2,
    ),
    "qwen2": PruneTarget(
        hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2
    ),
    "gpt2": PruneTarget(
        hidden_size=48, intermediate_size=64, num_attention_heads=3, num_hidden_layers=2
    ),
}


def expected_params(config: Any, arch: str) -> int:
    """Parameter count from the config alone (the formula the pruned model must satisfy)."""
    V = config.vocab_size
    if arch == "gpt2":
        H, F, L = config.n_embd, config.n_inner, config.n_layer
        per_layer = 4 * H + (3 * H * H + 3 * H) + (H * H + H) + (H * F + F) + (F * H + H)
        return V * H + config.n_positions * H + 2 * H + L * per_layer
    H, F, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = 2 * H * q + 2 * H * kv + 3 * H * F + 2 * H
    if arch == "qwen2":
        per_layer += q + 2 * kv
    lm_head = 0 if config.tie_word_embeddings else V * H
    return V * H + lm_head + H + L * per_layer


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_noop_target_is_exact_copy(arch, make, data):
    model = make(arch)
    scores = collect_importance(model, data())
    student = prune(model, scores, PruneTarget())
    ids = data(1, seed=1)[0]["input_ids"]
    torch.testing.assert_close(logits(student, ids), logits(model, ids), rtol=0, atol=0)
    assert type(student) is type(model)
    assert student.config.to_dict() | {"head_dim": None} == model.config.to_dict() | {
        "head_dim": None
    }


def test_prune_reload_identical_logits_and_generation(arch, make, data, tmp_path):
    model = make(arch)
    student = prune(model, collect_importance(model, data()), TARGETS[arch])
    student.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model)
    ids = data(1, seed=1)[0]["input_ids"]
    torch.testing.assert_close(logits(reloaded, ids), logits(student, ids), rtol=0, atol=0)
    prompt = ids[:, :5]
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    out_a = student.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    out_b = reloaded.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    assert out_a.shape == (2, 11)
    assert torch.equal(out_a, out_b)


def test_config_fields_and_param_count(arch, make, data):
    model = make(arch)
    target = TARGETS[arch]
    student = prune(model, collect_importance(model, data()), target)
    c = student.config
    assert c.hidden_size == target.hidden_size
    assert c.num_attention_heads == target.num_attention_heads
    assert (
        c.num_hidden_layers
        == target.num_hidden_layers
        == len(student.base_model.layers if arch != "gpt2" else student.transformer.h)
    )
    if arch == "gpt2":
        assert c.n_inner == target.intermediate_size
    else:
        assert c.intermediate_size == target.intermediate_size
        assert c.head_dim == model.config.head_dim
        assert c.num_key_value_heads == (
            target.num_key_value_heads or model.config.num_key_value_heads
        )
    n = sum(p.numel() for p in student.parameters())
    assert n == expected_params(c, arch)
    assert sum(p.numel() for p in model.parameters()) == expected_params(model.config, arch)


def test_input_model_unchanged_and_storage_not_shared(arch, make, data):
    model = make(arch).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config_before = model.config.to_dict()
    student = prune(model, collect_importance(model, data()), TARGETS[arch])
    assert model.training
    assert student.training
    assert model.config.to_dict() == config_before
    after = model.state_dict()
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert torch.equal(value, after[key]), key
    old_ptrs = {p.data_ptr() for p in model.parameters()}
    assert not old_ptrs & {p.data_ptr() for p in student.parameters()}
    noop = prune(model, collect_importance(model, data()), PruneTarget())
    assert not old_ptrs & {p.data_ptr() for p in noop.parameters()}


def test_depth_pruning_renumbers_layers_and_slices_layer_types(make, data):
    model = make(
        "qwen2",
        num_hidden_layers=4,
        layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2,
        use_sliding_window=True,
        sliding_window=4,
    )
    student = prune(model, collect_importance(model, data()), PruneTarget(drop_layers=(0, 2)))
    assert student.config.layer_types == ["full_attention", "sliding_attention"]
    assert [layer.self_attn.layer_idx for layer in student.model.layers] == [0, 1]
    for new, old in zip(student.model.layers, (1, 3), strict=True):
        assert torch.equal(new.mlp.up_proj.weight, model.model.layers[old].mlp.up_proj.weight)


def test_tied_embeddings_pruned_once_and_retied(make, data, tmp_path):
    model = make("llama")
    student = prune(model, collect_importance(model, data()), TARGETS["llama"])
    assert student.lm_head.weight is student.model.embed_tokens.weight
    student.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()


# --- dead structures: importance must find them and pruning them must change nothing --------


def _layers(model: Any) -> Any:
    return model.transformer.h if model.config.model_type == "gpt2" else model.model.layers


@torch.no_grad()
def test_dead_neurons_pruned_exactly(arch, make, data):
    model = make(arch)
    ffn = 96
    dead = [torch.randperm(ffn, generator=torch.Generator().manual_seed(i))[:32] for i in range(3)]
    for layer, idx in zip(_layers(model), dead, strict=True):
        if arch == "gpt2":  # gelu(0) = 0
            layer.mlp.c_fc.weight[:, idx] = 0
            layer.mlp.c_fc.bias[idx] = 0
        else:  # silu(gate) * 0 = 0
            layer.mlp.up_proj.weight[idx] = 0
    scores = collect_importance(model, data())
    for i, idx in enumerate(dead):
        assert torch.all(scores.neurons[i, idx] == 0)
        keep = torch.ones(ffn, dtype=torch.bool)
        keep[idx] = False
        assert torch.all(scores.neurons[i, keep] > 0)
    student = prune(model, scores, PruneTarget(intermediate_size=ffn - 32))
    ids = data(1, seed=1)[0]["input_ids"]
    torch.testing.assert_close(logits(student, ids), logits(model, ids), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_dead_layer_dropped_exactly(arch, make, data):
    model = make(arch)
    layer = _layers(model)[1]
    if arch == "gpt2":
        for m in (layer.attn.c_proj, layer.mlp.c_proj):
            m.weight.zero_()
            m.bias.zero_()
    else:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    scores = collect_importance(model, data())
    assert scores.lm_loss_increase is not None
    assert scores.lm_loss_increase[1] == 0
    assert abs(float(scores.block_importance[1])) < 1e-6
    assert torch.all(scores.block_importance[[0, 2]] > 1e-3)
    student = prune(model, scores, PruneTarget(num_hidden_layers=2))
    ids = data(1, seed=1)[0]["input_ids"]
    torch.testing.assert_close(logits(student, ids), logits(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch_", ["llama", "mistral", "qwen2"])
@torch.no_grad()
def test_dead_kv_group_pruned_exactly(arch_, make, data):
    model = make(arch_)  # 8 query heads, 2 KV groups of 4, head_dim 8
    for layer, group in zip(model.model.layers, (0, 1, 1), strict=True):
        rows = slice(group * 8, (group + 1) * 8)
        layer.self_attn.v_proj.weight[rows] = 0
        if layer.self_attn.v_proj.bias is not None:
            layer.self_attn.v_proj.bias[rows] = 0
    scores = collect_importance(model, data())
    assert torch.all(scores.heads[0, :4] == 0)
    assert torch.all(scores.heads[0, 4:] > 0)
    assert torch.all(scores.heads[1, 4:] == 0)
    assert torch.all(scores.heads[1, :4] > 0)
    student = prune(model, scores, PruneTarget(num_attention_heads=4, num_key_value_heads=1))
    assert student.model.layers[0].self_attn.k_proj.out_features == 8
    ids = data(1, seed=1)[0]["input_ids"]
    torch.testing.assert_close(logits(student, ids), logits(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch_", ["llama", "mistral", "qwen2"])
@torch.no_grad()
def test_dead_hidden_channels_pruned_exactly(arch_, make, data):
    # RMSNorm divides by the RMS over all channels: with eps = 0 dropping k zero channels scales
    # every norm output by sqrt((H - k) / H), which the test undoes on the pruned model.
    model = make(arch_, rms_norm_eps=0.0)
    H, k = 64, 16
    dead = torch.randperm(H, generator=torch.Generator().manual_seed(3))[:k]
    model.model.embed_tokens.weight[:, dead] = 0
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[dead] = 0
        layer.mlp.down_proj.weight[dead] = 0
    scores = collect_importance(model, data())
    assert torch.all(scores.hidden[dead] == 0)
    assert int((scores.hidden > 0).sum()) == H - k
    student = prune(model, scores, PruneTarget(hidden_size=H - k))
    for name, p in student.named_parameters():
        if "norm" in name:
            p.mul_(math.sqrt(H / (H - k)))
    ids = data(1, seed=1)[0]["input_ids"]
    torch.testing.assert_close(logits(student, ids), logits(model, ids), rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_gpt2_dead_heads_get_zero_score_and_are_sliced_out(make, data):
    model = make("gpt2")  # 4 heads x 16, c_attn = [q | k | v]
    for layer, head in zip(model.transformer.h, (0, 2, 3), strict=True):
        cols = slice(128 + head * 16, 128 + (head + 1) * 16)
        layer.attn.c_attn.weight[:, cols] = 0
        layer.attn.c_attn.bias[cols] = 0
    scores = collect_importance(model, data())
    for i, head in enumerate((0, 2, 3)):
        assert scores.heads[i, head] == 0
        assert int((scores.heads[i] > 0).sum()) == 3
    student = prune(model, scores, PruneTarget(num_attention_heads=3, hidden_size=48))
    hidden = torch.sort(torch.sort(scores.hidden, descending=True, stable=True).indices[:48]).values
    for i, head in enumerate((0, 2, 3)):
        kept = torch.tensor([h for h in range(4) if h != head])
        ch = (kept[:, None] * 16 + torch.arange(16)).reshape(-1)
        cols = torch.cat([ch, ch + 64, ch + 128])
        old, new = model.transformer.h[i].attn, student.transformer.h[i].attn
        torch.testing.assert_close(new.c_attn.weight, old.c_attn.weight[hidden][:, cols])
        torch.testing.assert_close(new.c_attn.bias, old.c_attn.bias[cols])
        torch.testing.assert_close(new.c_proj.weight, old.c_proj.weight[ch][:, hidden])


# --- GQA bookkeeping with hand-made scores ----------------------------------------------------


def _scores_with_heads(model, data, heads: torch.Tensor) -> Any:
    scores = collect_importance(model, data(), layer_loss=False)
    return dataclasses.replace(scores, heads=heads)


@torch.no_grad()
def test_query_heads_ranked_within_their_kv_group(make, data):
    model = make("qwen2")  # 8 query heads in 2 groups of 4
    # Globally the best four heads are all in group 0; per group the best two are kept.
    per_layer = torch.tensor([9.0, 1.0, 8.0, 7.0, 0.1, 0.4, 0.3, 0.2])
    student = prune(
        model,
        _scores_with_heads(model, data, per_layer.expand(3, 8).clone()),
        PruneTarget(num_attention_heads=4),
    )
    kept = torch.tensor([0, 2, 5, 6])
    ch = (kept[:, None] * 8 + torch.arange(8)).reshape(-1)
    for old, new in zip(model.model.layers, student.model.layers, strict=True):
        torch.testing.assert_close(new.self_attn.q_proj.weight, old.self_attn.q_proj.weight[ch])
        torch.testing.assert_close(new.self_attn.q_proj.bias, old.self_attn.q_proj.bias[ch])
        torch.testing.assert_close(new.self_attn.o_proj.weight, old.self_attn.o_proj.weight[:, ch])
        torch.testing.assert_close(new.self_attn.k_proj.weight, old.self_attn.k_proj.weight)
        torch.testing.assert_close(new.self_attn.v_proj.bias, old.self_attn.v_proj.bias)


@torch.no_grad()
def test_kv_group_pruning_keeps_the_best_group_and_its_heads(make, data):
    model = make("qwen2")
    per_layer = torch.tensor([1.0, 1.0, 1.0, 3.0, 2.0, 2.0, 2.0, 2.0])  # L2: 3.46 < 4.0
    student = prune(
        model,
        _scores_with_heads(model, data, per_layer.expand(3, 8).clone()),
        PruneTarget(num_attention_heads=2, num_key_value_heads=1),
    )
    q = (torch.tensor([4, 5])[:, None] * 8 + torch.arange(8)).reshape(-1)
    kv = torch.arange(8, 16)
    for old, new in zip(model.model.layers, student.model.layers, strict=True):
        torch.testing.assert_close(new.self_attn.q_proj.weight, old.self_attn.q_proj.weight[q])
        torch.testing.assert_close(new.self_attn.k_proj.weight, old.self_attn.k_proj.weight[kv])
        torch.testing.assert_close(new.self_attn.v_proj.bias, old.self_attn.v_proj.bias[kv])


@torch.no_grad()
def test_zero_output_query_head_pruned_exactly(make, data):
    """A query head whose o_proj columns are zero contributes nothing: dropping it is exact."""
    model = make("llama")
    for layer in model.model.layers:
        for head in (1, 2, 5, 7):  # two per KV group of 4
            layer.self_attn.o_proj.weight[:, 8 * head : 8 * (head + 1)] = 0
    heads = torch.ones(3, 8)
    heads[:, [1, 2, 5, 7]] = 0
    student = prune(
        model, _scores_with_heads(model, data, heads), PruneTarget(num_attention_heads=4)
    )
    ids = data(1, seed=1)[0]["input_ids"]
    torch.testing.assert_close(logits(student, ids), logits(model, ids), rtol=1e-5, atol=1e-5)


def test_mha_model_follows_heads_when_kv_not_given(make, data):
    model = make("llama", num_key_value_heads=8)
    student = prune(model, collect_importance(model, data()), PruneTarget(num_attention_heads=4))
    assert student.config.num_key_value_heads == 4
    assert student.model.layers[0].self_attn.k_proj.out_features == 32
