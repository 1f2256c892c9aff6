"""Dead hidden channels of the LayerNorm families (GPT-2, GPT-NeoX) are pruned exactly.

A LayerNorm subtracts the mean over all channels, so zero channels alone do not make pruning
exact (dropping them changes the mean). The test makes the model provably blind to `k` hidden
channels: every tensor that writes into the residual stream (token and position embeddings, the
attention and MLP output projections and their biases) is zero on the dead channels and has
zero mean over the live ones, so the stream always has mean 0 and zeros on the dead channels;
every LayerNorm has weight and bias 0 there, so nothing downstream reads them. With `eps = 0`
dropping the dead channels then only rescales each norm's variance by ``(H - k) / H``, which the
test undoes on the pruned model (LayerNorm weight x ``sqrt(H / (H - k))``). GPT-2 and GPT-NeoX
tie the attention width to the hidden size, so one head per layer (a different one in each)
dies with them (zero value rows).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from prune_distill import PruneTarget, collect_importance, prune


def _center(t: torch.Tensor, dim: int, live: torch.Tensor, dead: torch.Tensor) -> None:
    """In place: zero `t` on the `dead` entries of `dim`, zero mean over the `live` ones."""
    x = t.movedim(dim, -1)  # a view: assignments write into `t`
    x[..., dead] = 0
    x[..., live] -= x[..., live].mean(dim=-1, keepdim=True)


def _layer_norms(model: Any) -> list[torch.nn.LayerNorm]:
    return [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]


def _kill(model: Any, arch: str, dead: torch.Tensor, dead_heads: tuple[int, ...]) -> None:
    H = model.config.hidden_size
    d = H // model.config.num_attention_heads
    live = torch.tensor([c for c in range(H) if c not in set(dead.tolist())])
    if arch == "gpt2":  # Conv1D weights are [in, out]: the hidden output is dim 1
        _center(model.transformer.wte.weight, 1, live, dead)
        _center(model.transformer.wpe.weight, 1, live, dead)
        for layer, h in zip(model.transformer.h, dead_heads, strict=True):
            for proj in (layer.attn.c_proj, layer.mlp.c_proj):
                _center(proj.weight, 1, live, dead)
                _center(proj.bias, 0, live, dead)
            v = slice(2 * H + h * d, 2 * H + (h + 1) * d)  # c_attn = [q | k | v]
            layer.attn.c_attn.weight[:, v] = 0
            layer.attn.c_attn.bias[v] = 0
    else:  # GPT-NeoX: Linear weights are [out, in]; query_key_value is [q_h | k_h | v_h] per head
        _center(model.gpt_neox.embed_in.weight, 1, live, dead)
        for layer, h in zip(model.gpt_neox.layers, dead_heads, strict=True):
            for proj in (layer.attention.dense, layer.mlp.dense_4h_to_h):
                _center(proj.weight, 0, live, dead)
                _center(proj.bias, 0, live, dead)
            v = slice(h * 3 * d + 2 * d, (h + 1) * 3 * d)
            layer.attention.query_key_value.weight[v] = 0
            layer.attention.query_key_value.bias[v] = 0
    for norm in _layer_norms(model):
        norm.weight[dead] = 0
        norm.bias[dead] = 0


@pytest.mark.parametrize("arch_", ["gpt2", "gpt_neox"])
@torch.no_grad()
def test_dead_hidden_channels_pruned_exactly(arch_, make, data):
    eps = {"gpt2": "layer_norm_epsilon", "gpt_neox": "layer_norm_eps"}[arch_]
    model = make(arch_, **{eps: 0.0})
    c = model.config
    H, heads = c.hidden_size, c.num_attention_heads
    d = H // heads
    dead = torch.randperm(H, generator=torch.Generator().manual_seed(3))[:d]
    dead_heads = (1, 3, 0)
    _kill(model, arch_, dead, dead_heads)
    ids = data(1, seed=1)[0]["input_ids"]
    # The construction holds: every layer's input stream (the last entry is after the final
    # norm) is 0 on the dead channels and has mean 0 over the live ones.
    for stream in model(input_ids=ids, output_hidden_states=True).hidden_states[:-1]:
        assert torch.all(stream[..., dead] == 0)
        assert stream.sum(-1).abs().max() < 1e-4 * stream.abs().sum(-1).max()

    scores = collect_importance(model, data())
    assert torch.all(scores.hidden[dead] == 0)
    assert int((scores.hidden > 0).sum()) == H - d
    for i, h in enumerate(dead_heads):
        assert scores.heads[i, h] == 0
        assert int((scores.heads[i] > 0).sum()) == heads - 1

    student = prune(model, scores, PruneTarget(hidden_size=H - d, num_attention_heads=heads - 1))
    assert (student.config.hidden_size, student.config.num_attention_heads) == (H - d, heads - 1)
    kept = torch.sort(torch.sort(scores.hidden, descending=True, stable=True).indices[: H - d])
    assert not set(kept.values.tolist()) & set(dead.tolist())
    before = model(input_ids=ids).logits
    for norm in _layer_norms(student):  # undo the variance over fewer channels (eps = 0)
        norm.weight.mul_(math.sqrt(H / (H - d)))
    torch.testing.assert_close(student(input_ids=ids).logits, before, rtol=1e-4, atol=1e-5)
    # Without the analytic rescale the logits differ: the test is not vacuous.
    for norm in _layer_norms(student):
        norm.weight.div_(math.sqrt(H / (H - d)))
    assert (student(input_ids=ids).logits - before).abs().max() > 1e-3
