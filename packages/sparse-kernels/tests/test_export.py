"""Export: HF save_pretrained / from_pretrained round trip and the compact format are exact."""

import pytest
import torch
from transformers import LlamaForCausalLM

from leanlm_testing.models import random_batches, tiny_llama
from sparse_kernels import SparsityConfig, masks, sparsify_, to_block_sparse_
from sparse_kernels.export import (
    load_compressed_,
    load_masks_,
    pack_bits,
    save_compressed,
    save_pretrained_sparse,
    unpack_bits,
)


def test_bit_packing_round_trip():
    for shape in [(1,), (3, 5), (17, 33)]:
        m = torch.rand(shape) > 0.5
        packed = pack_bits(m)
        assert packed.dtype == torch.uint8
        assert packed.numel() == -(-m.numel() // 8)
        assert torch.equal(unpack_bits(packed, shape), m)


def _sparse_model(pattern):
    model = tiny_llama()
    batches = random_batches(256, batches=1)
    sparsify_(
        model,
        SparsityConfig(pattern=pattern, method="wanda", sparsity=0.6, block_size=16),
        calibration=batches,
    )
    return model, batches[0]


def test_save_pretrained_reloads_with_identical_outputs(tmp_path):
    model, batch = _sparse_model("2:4")
    expected = model(**batch).logits
    save_pretrained_sparse(model, tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(reloaded(**batch).logits, expected, atol=0, rtol=0)
    got = load_masks_(reloaded, tmp_path)
    saved = masks(model)
    assert set(got) == set(saved)
    for name in saved:
        assert torch.equal(got[name], saved[name])
    torch.testing.assert_close(reloaded(**batch).logits, expected, atol=0, rtol=0)


def test_compressed_round_trip_is_exact_and_smaller(tmp_path):
    for pattern in ["2:4", "unstructured"]:
        model, batch = _sparse_model(pattern)
        expected = model(**batch).logits
        size = save_compressed(model, tmp_path / f"{pattern[0]}.safetensors")
        fresh = tiny_llama(seed=3)
        got = load_compressed_(fresh, tmp_path / f"{pattern[0]}.safetensors")
        torch.testing.assert_close(fresh(**batch).logits, expected, atol=0, rtol=0)
        for name, mask in masks(model).items():
            assert torch.equal(got[name], mask)
            assert torch.equal(masks(fresh)[name], mask)
        dense_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        # 2:4: linears at 50% + 1/32 meta (fp32); unstructured 60%: 40% kept + 1/32 bitmask
        assert size < 0.75 * dense_bytes, (pattern, size, dense_bytes)


def test_compressed_stores_tied_weights_once(tmp_path):
    from safetensors import safe_open

    model, batch = _sparse_model("2:4")  # tiny_llama ties lm_head to the input embedding
    assert model.lm_head.weight is model.model.embed_tokens.weight
    expected = model(**batch).logits
    size = save_compressed(model, tmp_path / "tied.safetensors")
    with safe_open(str(tmp_path / "tied.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys
    assert "model.embed_tokens.weight" in keys
    embedding_bytes = model.lm_head.weight.numel() * 4
    fresh = tiny_llama(seed=3)
    load_compressed_(fresh, tmp_path / "tied.safetensors")
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    torch.testing.assert_close(fresh(**batch).logits, expected, atol=0, rtol=0)
    dense_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    # the dense state dict counts the tied embedding twice; the file holds it once
    assert size < dense_bytes - embedding_bytes


def test_compressed_round_trip_of_a_masked_root_linear(tmp_path):
    from safetensors import safe_open
    from torch import nn

    from sparse_kernels import apply_mask_

    for mask in [torch.rand(4, 8) > 0.5, torch.tensor([[1, 1, 0, 0] * 2] * 4, dtype=torch.bool)]:
        lin = nn.Linear(8, 4)
        apply_mask_(lin, mask)
        path = tmp_path / "root.safetensors"
        save_compressed(lin, path)
        with safe_open(str(path), framework="pt") as f:
            assert not any(key.startswith(".") for key in f.keys())  # noqa: SIM118
        fresh = nn.Linear(8, 4)
        got = load_compressed_(fresh, path)
        assert set(got) == {""}
        assert torch.equal(got[""], mask)
        assert torch.equal(masks(fresh)[""], mask)
        assert torch.equal(fresh.weight, lin.weight)
        assert torch.equal(fresh.bias, lin.bias)


def test_other_parametrizations_are_saved(tmp_path):
    # before: every `.parametrizations.` key was dropped, so a weight_norm conv (Wav2Vec2's
    # positional convolution) was missing from both files and reloaded at random
    conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 4, 3))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), conv)
    sparsify_(model, SparsityConfig(pattern="unstructured", sparsity=0.5, targets=[r"^0$"]))
    x = torch.randn(2, 4, 6)  # the Linear acts on the length, the conv on the 4 channels
    expected = model(x)
    save_compressed(model, tmp_path / "c.safetensors")
    fresh = torch.nn.Sequential(
        torch.nn.Linear(6, 8),
        torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 4, 3)),
    )
    load_compressed_(fresh, tmp_path / "c.safetensors")
    torch.testing.assert_close(fresh(x), expected, atol=0, rtol=0)


def test_a_masked_lm_head_tied_to_the_embedding_round_trips(tmp_path):
    # before: the head's masked values were loaded into the shared Parameter and the mask
    # zeroed it, so the embedding came back masked (logits 0.20 off after one step)
    model = tiny_llama()  # tied
    sparsify_(model, SparsityConfig(pattern="2:4", targets=[r"lm_head", r"layers\.\d+\.mlp"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = random_batches(256, batches=1)[0]
    model(**batch, labels=batch["input_ids"]).loss.backward()
    opt.step()
    embedding = model.model.embed_tokens.weight.detach().clone()
    assert not torch.equal(embedding, model.lm_head.weight)  # the head's view is masked
    expected = model(**batch).logits
    save_compressed(model, tmp_path / "c.safetensors")
    fresh = tiny_llama(seed=4)
    load_compressed_(fresh, tmp_path / "c.safetensors")
    assert torch.equal(fresh.model.embed_tokens.weight, embedding)
    assert torch.equal(masks(fresh)["lm_head"], masks(model)["lm_head"])
    torch.testing.assert_close(fresh(**batch).logits, expected, atol=0, rtol=0)


def test_load_masks_checks_every_layer_before_attaching_any(tmp_path):
    model, _ = _sparse_model("unstructured")
    save_pretrained_sparse(model, tmp_path)
    other = tiny_llama(intermediate_size=160)
    with pytest.raises(ValueError, match=r"mask of shape \(176, 64\) for 'model.layers.0.mlp"):
        load_masks_(other, tmp_path)
    assert masks(other) == {}  # before: 4 masks attached, then an unnamed shape error
    blocky = tiny_llama()
    sparsify_(blocky, SparsityConfig(pattern="block", sparsity=0.5, block_size=16))
    to_block_sparse_(blocky, block_size=16)
    with pytest.raises(ValueError, match="`load_masks_` does not handle BlockSparseLinear"):
        load_masks_(blocky, tmp_path)  # before: a bare AssertionError
