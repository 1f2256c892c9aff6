"""Pruning: exactness of the bookkeeping, reload equivalence, configs and parameter counts."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from prune_distill import PruneTarget, collect_importance, prune

# Module paths, written from the transformers modeling code (independently of the adapters).
LAYERS = {"gpt2": "transformer.h", "gpt_neox": "gpt_neox.layers"}
ATTN_OUT = {"gpt2": "attn.c_proj", "gpt_neox": "attention.dense"}
MLP_OUT = {"gpt2": "mlp.c_proj", "gpt_neox": "mlp.dense_4h_to_h"}
GQA_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "olmo2"]
RMS_ARCHS = [*GQA_ARCHS, "gemma2", "granite"]


def _layers(model: Any) -> Any:
    return model.get_submodule(LAYERS.get(model.config.model_type, "model.layers"))


def _zero(module: Any, rows: Any = None) -> None:
    """Zero a projection's weight (and bias), or only its output `rows` (Linear layout)."""
    for name in ("weight", "bias"):
        t = getattr(module, name, None)
        if t is not None:
            if rows is None:
                t.zero_()
            else:
                t[rows] = 0


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
    assert student.config.to_dict() == model.config.to_dict()  # head_dim included


def test_prune_reload_identical_logits_and_generation(arch, make, data, targets, tmp_path):
    model = make(arch)
    student = prune(model, collect_importance(model, data()), targets[arch])
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


def test_config_fields_and_param_count(arch, make, data, targets):
    model = make(arch)
    target = targets[arch]
    student = prune(model, collect_importance(model, data()), target)
    c, old = student.config, model.config
    assert type(c) is type(old)
    assert c.num_hidden_layers == target.num_hidden_layers == len(_layers(student))
    assert c.hidden_size == target.hidden_size
    assert c.num_attention_heads == target.num_attention_heads
    if arch == "gpt2":
        assert c.n_inner == target.intermediate_size
    else:
        assert c.intermediate_size == target.intermediate_size
    if arch not in ("gpt2", "gpt_neox"):
        assert c.head_dim == old.head_dim
        mha = old.num_key_value_heads == old.num_attention_heads  # KV heads follow the heads
        expect_kv = c.num_attention_heads if mha else old.num_key_value_heads
        assert c.num_key_value_heads == (target.num_key_value_heads or expect_kv)
    kept = pruned_layers(model, target)
    if getattr(old, "layer_types", None) is not None:
        assert c.layer_types == [old.layer_types[i] for i in kept]
    n = sum(p.numel() for p in student.parameters())
    assert n < sum(p.numel() for p in model.parameters())
    if arch in ("llama", "mistral", "qwen2", "gpt2"):
        assert n == expected_params(c, arch)
        assert sum(p.numel() for p in model.parameters()) == expected_params(old, arch)


def pruned_layers(model: Any, target: PruneTarget) -> list[int]:
    scores = collect_importance(model, batches_for(model))
    order = torch.sort(scores.block_importance, descending=True, stable=True).indices
    return sorted(int(i) for i in order[: target.num_hidden_layers])


def batches_for(model: Any) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 128, (2, 12), generator=gen)} for _ in range(2)]


def test_input_model_unchanged_and_storage_not_shared(arch, make, data, targets):
    model = make(arch).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config_before = model.config.to_dict()
    student = prune(model, collect_importance(model, data()), targets[arch])
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


def test_tied_embeddings_pruned_once_and_retied(make, data, targets, tmp_path):
    model = make("llama")
    student = prune(model, collect_importance(model, data()), targets["llama"])
    assert student.lm_head.weight is student.model.embed_tokens.weight
    student.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()


# --- dead structures: importance must find them and pruning them must change nothing --------


def _kill_neurons(model: Any, arch: str, layer: Any, idx: torch.Tensor) -> None:
    """Make MLP neurons `idx` output exactly 0 (so their activation entering down is 0)."""
    if arch == "gpt2":  # gelu(0) = 0, Conv1D weight [in, out]
        layer.mlp.c_fc.weight[:, idx] = 0
        layer.mlp.c_fc.bias[idx] = 0
    elif arch == "gpt_neox":  # gelu(0) = 0
        _zero(layer.mlp.dense_h_to_4h, idx)
    elif arch == "phi3":  # [gate | up]: act(gate) * 0 = 0
        layer.mlp.gate_up_proj.weight[model.config.intermediate_size + idx] = 0
    else:  # act(gate) * up, up = 0
        _zero(layer.mlp.up_proj, idx)


@torch.no_grad()
def test_dead_neurons_pruned_exactly(arch, make, data):
    model = make(arch)
    ffn = _layers(model)[0].get_submodule(MLP_OUT.get(arch, "mlp.down_proj")).weight.shape
    ffn = ffn[0] if arch == "gpt2" else ffn[1]
    dead = [torch.randperm(ffn, generator=torch.Generator().manual_seed(i))[:32] for i in range(3)]
    for layer, idx in zip(_layers(model), dead, strict=True):
        _kill_neurons(model, arch, layer, idx)
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
    _zero(layer.get_submodule(ATTN_OUT.get(arch, "self_attn.o_proj")))
    _zero(layer.get_submodule(MLP_OUT.get(arch, "mlp.down_proj")))
    scores = collect_importance(model, data())
    assert scores.lm_loss_increase is not None
    assert scores.lm_loss_increase[1] == 0
    assert abs(float(scores.block_importance[1])) < 1e-6
    assert torch.all(scores.block_importance[[0, 2]] > 1e-3)
    student = prune(model, scores, PruneTarget(num_hidden_layers=2))
    ids = data(1, seed=1)[0]["input_ids"]
    torch.testing.assert_close(logits(student, ids), logits(model, ids), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_gpt2_depth_pruning_keeps_inverse_layer_idx_scale(make, data, tmp_path):
    """With scale_attn_by_inverse_layer_idx, layer i divides scores by i + 1: renumbering a kept
    layer must not change its scale."""
    model = make("gpt2", scale_attn_by_inverse_layer_idx=True)
    for i in (0, 1):
        _zero(model.transformer.h[i].attn.c_proj)
        _zero(model.transformer.h[i].mlp.c_proj)
    student = prune(model, collect_importance(model, data()), PruneTarget(drop_layers=(0, 1)))
    ids = data(1, seed=1)[0]["input_ids"]
    torch.testing.assert_close(logits(student, ids), logits(model, ids), rtol=1e-5, atol=1e-5)
    student.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(logits(reloaded, ids), logits(student, ids), rtol=0, atol=0)


def _norm_scale(model: Any, name: str, size: int, factor: float) -> None:
    """Multiply the scale of every norm over `size` channels whose name contains `name`
    (Gemma stores the scale as 1 + weight)."""
    gemma = model.config.model_type.startswith("gemma")
    for pname, p in model.named_parameters():
        if name in pname and p.dim() == 1 and p.numel() == size:
            p.copy_((1 + p) * factor - 1 if gemma else p * factor)


@pytest.mark.parametrize("arch_", GQA_ARCHS)
@torch.no_grad()
def test_dead_kv_group_pruned_exactly(arch_, make, data):
    model = make(arch_, **({"rms_norm_eps": 0.0} if arch_ == "olmo2" else {}))
    c = model.config
    hd, group = c.head_dim, c.num_attention_heads // c.num_key_value_heads
    q_width, kv_width = c.num_attention_heads * hd, c.num_key_value_heads * hd
    dead_groups = (0, 1, 1)
    for layer, g in zip(model.model.layers, dead_groups, strict=True):
        kv_rows = torch.arange(g * hd, (g + 1) * hd)
        if arch_ == "phi3":  # qkv_proj = [q | k | v]
            layer.self_attn.qkv_proj.weight[q_width + kv_width + kv_rows] = 0
        else:
            _zero(layer.self_attn.v_proj, kv_rows)
        if arch_ == "olmo2":  # q/k norms span all heads: make the dropped channels zero too
            _zero(layer.self_attn.k_proj, kv_rows)
            _zero(layer.self_attn.q_proj, torch.arange(g * group * hd, (g + 1) * group * hd))
    scores = collect_importance(model, data())
    for i, g in enumerate(dead_groups):
        in_group = torch.zeros(c.num_attention_heads, dtype=torch.bool)
        in_group[g * group : (g + 1) * group] = True
        assert torch.all(scores.heads[i, in_group] == 0)
        assert torch.all(scores.heads[i, ~in_group] > 0)
    kv = c.num_key_value_heads - 1
    student = prune(
        model, scores, PruneTarget(num_attention_heads=kv * group, num_key_value_heads=kv)
    )
    assert student.model.layers[0].self_attn.o_proj.in_features == kv * group * hd
    if arch_ == "olmo2":  # with eps = 0, dropping zero channels rescales the RMS analytically
        _norm_scale(student, "q_norm", kv * group * hd, (q_width / (kv * group * hd)) ** 0.5)
        _norm_scale(student, "k_norm", kv * hd, (kv_width / (kv * hd)) ** 0.5)
    ids = data(1, seed=1)[0]["input_ids"]
    torch.testing.assert_close(logits(student, ids), logits(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch_", RMS_ARCHS)
@torch.no_grad()
def test_dead_hidden_channels_pruned_exactly(arch_, make, data):
    # RMSNorm divides by the RMS over all channels: with eps = 0 dropping k zero channels scales
    # every norm output by sqrt((H - k) / H), which the test undoes on the pruned model. Gemma's
    # sqrt(hidden) embedding scale is compensated by `prune` itself (nothing undone here).
    model = make(arch_, rms_norm_eps=0.0)
    H = model.config.hidden_size
    k = H // 4
    dead = torch.randperm(H, generator=torch.Generator().manual_seed(3))[:k]
    model.model.embed_tokens.weight[:, dead] = 0
    for layer in model.model.layers:
        _zero(layer.self_attn.o_proj, dead)
        _zero(layer.mlp.down_proj, dead)
    scores = collect_importance(model, data())
    assert torch.all(scores.hidden[dead] == 0)
    assert int((scores.hidden > 0).sum()) == H - k
    student = prune(model, scores, PruneTarget(hidden_size=H - k))
    _norm_scale(student, "norm", H - k, math.sqrt(H / (H - k)))
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


_8X8 = {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8}


def _scores_with_heads(model, data, heads: torch.Tensor) -> Any:
    scores = collect_importance(model, data(), layer_loss=False)
    return dataclasses.replace(scores, heads=heads)


@torch.no_grad()
def test_query_heads_ranked_within_their_kv_group(make, data):
    model = make("qwen2", **_8X8)  # 8 query heads in 2 groups of 4
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
    model = make("qwen2", **_8X8)
    # Group 0 wins by L2 (4.91 > 4.0) but loses by sum or mean (5.5 < 8.0): the group kept
    # tells the aggregations apart. Its two best heads are 2 and 3.
    per_layer = torch.tensor([0.1, 0.2, 0.3, 4.9, 2.0, 2.0, 2.0, 2.0])
    assert per_layer[:4].norm() > per_layer[4:].norm()
    assert per_layer[:4].sum() < per_layer[4:].sum()
    student = prune(
        model,
        _scores_with_heads(model, data, per_layer.expand(3, 8).clone()),
        PruneTarget(num_attention_heads=2, num_key_value_heads=1),
    )
    q = (torch.tensor([2, 3])[:, None] * 8 + torch.arange(8)).reshape(-1)
    kv = torch.arange(0, 8)
    for old, new in zip(model.model.layers, student.model.layers, strict=True):
        torch.testing.assert_close(new.self_attn.q_proj.weight, old.self_attn.q_proj.weight[q])
        torch.testing.assert_close(new.self_attn.k_proj.weight, old.self_attn.k_proj.weight[kv])
        torch.testing.assert_close(new.self_attn.v_proj.bias, old.self_attn.v_proj.bias[kv])


@torch.no_grad()
def test_zero_output_query_head_pruned_exactly(make, data):
    """A query head whose o_proj columns are zero contributes nothing: dropping it is exact."""
    model = make("llama", **_8X8)
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
    model = make("llama", **{**_8X8, "num_key_value_heads": 8})
    student = prune(model, collect_importance(model, data()), PruneTarget(num_attention_heads=4))
    assert student.config.num_key_value_heads == 4
    assert student.model.layers[0].self_attn.k_proj.out_features == 32


def test_dynamic_rope_frequencies_come_from_the_config(make, data, tmp_path):
    """Dynamic-NTK RoPE rewrites `inv_freq` while the model runs on inputs longer than
    `max_position_embeddings`; the pruned model gets the config's frequencies, as a reload
    does. Before: calibration on long inputs left the copy with the stretched ones (a no-op
    prune differed from its teacher on short inputs and from its own reload), and long then
    short calibration batches (which alias `inv_freq` to `original_inv_freq`) crashed `prune`."""
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    short = data(1, batch_size=2, seq_len=10, seed=3)[0]["input_ids"]
    for calibration in (data(2, seq_len=80), [*data(1, seq_len=80), *data(1, seq_len=12)]):
        model = make("llama", max_position_embeddings=32, rope_parameters=rope)
        want = logits(model, short)
        student = prune(model, collect_importance(model, calibration), PruneTarget())
        torch.testing.assert_close(logits(student, short), want, rtol=0, atol=0)
        torch.testing.assert_close(logits(model, short), want, rtol=0, atol=0)
        student.save_pretrained(tmp_path)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        torch.testing.assert_close(logits(reloaded, short), want, rtol=0, atol=0)
