import pytest
import torch
import torch.distributed as dist

from leanlm_testing import assert_verbose_allclose, spawn
from leanlm_testing.models import LlamaShape, random_batches, tiny_llama


def test_allclose_passes_within_tolerance():
    x = torch.randn(7, 5)
    assert_verbose_allclose(x + 1e-7, x, atol=1e-6, rtol=0)


def test_allclose_reports_location_and_error():
    x = torch.randn(4, 3)
    y = x.clone()
    y[2, 1] += 1.0
    with pytest.raises(AssertionError, match=r"(?s)1 of 12 elements.*at \(2, 1\)"):
        assert_verbose_allclose(y, x, atol=1e-3, rtol=1e-3, name="w")


def test_allclose_rejects_shape_and_nan_mismatch():
    with pytest.raises(AssertionError, match="shape"):
        assert_verbose_allclose(torch.zeros(2), torch.zeros(3), atol=0, rtol=0)
    with pytest.raises(AssertionError, match="1 of 2"):
        assert_verbose_allclose(torch.tensor([1.0, float("nan")]), torch.ones(2), atol=0, rtol=0)


def _all_reduce_rank(rank, world_size, out_dir):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    torch.save(t, f"{out_dir}/r{rank}.pt")


@pytest.mark.distributed
def test_spawn_runs_a_gloo_group(tmp_path):
    spawn(_all_reduce_rank, str(tmp_path), world_size=2, tmp_path=tmp_path)
    for rank in range(2):
        assert torch.load(tmp_path / f"r{rank}.pt").item() == 3.0


def _fail(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on rank 1")


@pytest.mark.distributed
def test_spawn_reraises_worker_failure(tmp_path):
    with pytest.raises(Exception, match="boom on rank 1"):
        spawn(_fail, world_size=2, tmp_path=tmp_path)


def test_tiny_llama_is_deterministic_and_runs():
    a, b = tiny_llama(seed=3), tiny_llama(seed=3)
    batch = random_batches(a.config.vocab_size, batches=1)[0]
    with torch.no_grad():
        la, lb = a(**batch).logits, b(**batch).logits
    assert la.shape == (2, 16, 256)
    assert torch.equal(la, lb)
    assert a.config.num_key_value_heads < a.config.num_attention_heads


def test_llama_shape_sets_the_llama_config_sizes():
    shape = LlamaShape(vocab=300, hidden=48, layers=3, heads=6, kv_heads=3, ffn=80)
    model = shape.model(seed=1, max_position_embeddings=64, tie_word_embeddings=False)
    c = model.config
    sizes = (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads)
    assert sizes == (300, 48, 3, 6)
    assert (c.num_key_value_heads, c.intermediate_size) == (3, 80)
    assert (c.max_position_embeddings, c.tie_word_embeddings) == (64, False)
    assert not model.training
