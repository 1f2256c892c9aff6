"""Inputs from the prune-distill review (F1-F4) that used to pass silently or fail with raw errors.

F1: a top-k teacher (online `top_k`, offline `TeacherCache`, or a ``(values, indices)`` pair
passed to the losses) of another vocabulary is refused like the dense teacher. F2: calibration
data with no valid token is refused. F3: a loss `mask` of the right size but another shape is
refused. F4: a non-finite temperature, a non-int `top_k` for the cache and an `attention_mask`
shaped unlike `input_ids` are refused naming the argument.
"""

from __future__ import annotations

import re

import pytest
import torch

from prune_distill import (
    DistillConfig,
    TeacherCache,
    cache_teacher_topk,
    collect_importance,
    contiguous_block_search,
    distill,
    divergence,
    evaluate_kl,
    forward_kl,
    jsd,
    reverse_kl,
    validation_loss,
)
from prune_distill import _kl_kernels as K
from prune_distill.cache import TEACHER_VOCAB, TOPK_INDICES

STUDENT_VOCAB = 128  # conftest's VOCAB
VOCAB_MISMATCH = r"teacher vocab \({t}\) != student vocab \(128\): distillation needs the same"


def _shared_ids(data, vocab: int = 100) -> list[dict[str, torch.Tensor]]:
    """Batches whose ids are valid for both models (the smaller vocabulary is 100)."""
    return [{"input_ids": b["input_ids"] % vocab} for b in data(2)]


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, before: dict[str, torch.Tensor]) -> None:
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


# ------------------------------------------------------------------------------- F1: vocab
@pytest.mark.parametrize("teacher_vocab", [100, 160])
@pytest.mark.parametrize("loss", ["forward_kl", "jsd"])
def test_online_top_k_refuses_a_teacher_of_another_vocab(make, data, teacher_vocab, loss):
    """Smaller: trained silently before; larger: a raw gather index error (CUDA: device assert)."""
    student = make("qwen2", seed=2)
    teacher = make("qwen2", seed=1, vocab_size=teacher_vocab)
    before = _state(student)
    cfg = DistillConfig(top_k=8, max_steps=1, loss=loss)
    with pytest.raises(ValueError, match=VOCAB_MISMATCH.format(t=teacher_vocab)):
        distill(student, teacher, _shared_ids(data), cfg)
    _assert_unchanged(student, before)  # refused before any step
    # the dense path gives the same error, as it did before
    with pytest.raises(ValueError, match=VOCAB_MISMATCH.format(t=teacher_vocab)):
        distill(student, teacher, _shared_ids(data), DistillConfig(max_steps=1, loss=loss))


@pytest.mark.parametrize("teacher_vocab", [100, 160])
def test_offline_cache_records_and_checks_the_teacher_vocab(make, data, tmp_path, teacher_vocab):
    student = make("qwen2", seed=2)
    teacher = make("qwen2", seed=1, vocab_size=teacher_vocab)
    cache = cache_teacher_topk(teacher, _shared_ids(data), tmp_path / "c", top_k=teacher_vocab)
    record = next(iter(cache))
    assert record[TEACHER_VOCAB].dtype == torch.int64
    assert int(record[TEACHER_VOCAB]) == teacher_vocab
    before = _state(student)
    with pytest.raises(ValueError, match=VOCAB_MISMATCH.format(t=teacher_vocab)):
        distill(student, None, cache, DistillConfig(max_steps=1))
    _assert_unchanged(student, before)


def test_offline_cache_of_the_same_vocab_trains_and_feeds_other_functions(make, data, tmp_path):
    """The recorded size is no model input: distill, correct_teacher-style use and calibration
    on cached batches still work."""
    student, teacher = make("qwen2", seed=2), make("qwen2", seed=1)
    cache = cache_teacher_topk(teacher, data(2), tmp_path / "c", top_k=8)
    result = distill(student, None, cache, DistillConfig(max_steps=2))
    assert result.steps == 2
    assert collect_importance(teacher, cache, layer_loss=False).num_tokens == 2 * 2 * 12
    assert validation_loss(teacher, cache) > 0


def test_a_cache_without_the_recorded_vocab_has_its_indices_checked(make, data, tmp_path):
    """Caches written before the size was recorded: a larger teacher vocab is caught by its
    indices (read on the CPU as yielded), instead of a raw index error."""
    student = make("qwen2", seed=2)
    teacher = make("qwen2", seed=1, vocab_size=160)
    cache = cache_teacher_topk(teacher, _shared_ids(data), tmp_path / "c", top_k=160)
    high = 0
    for file in cache.files:  # what the old code wrote
        record = torch.load(file, weights_only=True)
        del record[TEACHER_VOCAB]
        high = max(high, int(record[TOPK_INDICES].max()))
        torch.save(record, file)
    assert high >= STUDENT_VOCAB
    expected = rf"`teacher` top-k indices span \[0, {high}\] but the student vocab has 128 ids"
    with pytest.raises(ValueError, match=expected):
        distill(student, None, TeacherCache(tmp_path / "c"), DistillConfig(max_steps=1))


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("loss", ["forward_kl", "jsd"])
@pytest.mark.parametrize("bad", [10, 12, -1])
def test_loss_refuses_top_k_indices_outside_the_student_vocab(bad, loss, chunk_size):
    s = torch.randn(2, 3, 10, requires_grad=True)
    values, indices = torch.topk(torch.randn(2, 3, 10), 4)
    indices[1, 2, 3] = bad
    low, high = min(int(indices.min()), bad), max(int(indices.max()), bad)
    expected = (
        rf"`teacher` top-k indices span \[{low}, {high}\] but the student vocab has 10 ids "
        r"\(0 to 9\): distillation needs the same tokenizer and vocabulary size"
    )
    with pytest.raises(ValueError, match=expected):
        divergence(s, (values, indices), loss=loss, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_loss_refuses_top_k_values_and_indices_of_other_shapes_or_float_indices(chunk_size):
    s = torch.randn(2, 3, 10, requires_grad=True)
    values, indices = torch.topk(torch.randn(2, 3, 10), 4)
    expected = (
        r"`teacher` top-k values have shape \(2, 3, 4\) but its indices \(2, 3, 3\): pass "
        r"\(values, indices\) of the same shape"
    )
    with pytest.raises(ValueError, match=expected):
        forward_kl(s, (values, indices[..., :3]), chunk_size=chunk_size)
    with pytest.raises(ValueError, match=r"`teacher` top-k indices have dtype torch.float32"):
        forward_kl(s, (values, indices.float()), chunk_size=chunk_size)
    # in range and well formed: unchanged (k = V equals the dense loss)
    t = torch.randn(2, 3, 10)
    torch.testing.assert_close(
        forward_kl(s, torch.topk(t, 10), chunk_size=chunk_size), forward_kl(s, t, chunk_size=None)
    )


# ------------------------------------------------------------------------ F2: no valid token
@pytest.mark.parametrize("layer_loss", [True, False])
def test_calibration_with_no_valid_token_is_refused(make, layer_loss):
    """All scores would be 0 and `prune` would keep the first channels and layers."""
    model = make("qwen2")
    ids = torch.ones(2, 6, dtype=torch.long)
    batches = [{"input_ids": ids, "attention_mask": torch.zeros_like(ids)}] * 2
    expected = (
        r"`batches` yielded no valid tokens \(`attention_mask` is 0 on all 4 sequences\): "
        "nothing to calibrate on"
    )
    with pytest.raises(ValueError, match=expected):
        collect_importance(model, batches, layer_loss=layer_loss)
    assert not model.training  # the mode is restored (make gives an eval-mode model)
    one_token = [{"input_ids": ids, "attention_mask": torch.zeros_like(ids)}]
    one_token[0]["attention_mask"][1, 0] = 1
    assert collect_importance(model, one_token, layer_loss=layer_loss).num_tokens == 1


# --------------------------------------------------------------------------- F3: mask shape
@pytest.mark.interpreter
@pytest.mark.parametrize("mask_shape", [(3, 2), (6, 1), (1, 6), (2, 3, 1)])
@pytest.mark.parametrize("path", ["plain", "chunked", "triton"])
@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
def test_a_mask_with_the_right_count_but_another_shape_is_refused(mask_shape, path, loss):
    """E.g. a (S, B) mask from a sequence-first pipeline: it weighted the wrong tokens."""
    chunk_size, backend = {"plain": (None, "torch"), "chunked": (2, "torch")}.get(
        path, (4, "triton")
    )
    if backend == "triton" and not K.available(torch.device("cpu")):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    s, t = torch.randn(2, 3, 10, requires_grad=True), torch.randn(2, 3, 10)
    mask = torch.ones(mask_shape)
    expected = (
        rf"`mask` has shape {re.escape(str(mask_shape))} but the logits have 6 token rows: "
        r"expected shape \(2, 3\) or \(6,\), flat in the logits' row order"
    )
    with pytest.raises(ValueError, match=expected):
        divergence(s, t, loss=loss, mask=mask, chunk_size=chunk_size, backend=backend)


def test_the_mask_of_the_logits_shape_and_its_flat_form_still_agree():
    s, t = torch.randn(2, 3, 10), torch.randn(2, 3, 10)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = forward_kl(s, t, mask=mask)
    assert torch.equal(out, forward_kl(s, t, mask=mask.reshape(-1)))
    rows = mask.reshape(-1).bool()
    ref = forward_kl(s.reshape(-1, 10)[rows], t.reshape(-1, 10)[rows], chunk_size=None)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------- F4: edge arguments
@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -1.0, True])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_forward_kl_refuses_a_non_finite_temperature(temperature, chunk_size):
    s, t = torch.randn(2, 3, 10), torch.randn(2, 3, 10)
    expected = rf"`temperature` \({re.escape(repr(temperature))}\) must be > 0 \(a finite number\)"
    with pytest.raises(ValueError, match=expected):
        forward_kl(s, t, temperature=temperature, chunk_size=chunk_size)
    with pytest.raises(ValueError, match=expected):
        forward_kl(s, torch.topk(t, 4), temperature=temperature, chunk_size=chunk_size)
    with pytest.raises(ValueError, match=expected):  # beta 0 is the forward KL
        jsd(s, t, beta=0.0, temperature=temperature, chunk_size=chunk_size)


@pytest.mark.parametrize("loss", ["reverse_kl", "jsd"])
def test_reverse_kl_and_jsd_refuse_an_infinite_temperature(loss):
    s, t = torch.randn(2, 3, 10), torch.randn(2, 3, 10)
    fn = reverse_kl if loss == "reverse_kl" else jsd
    with pytest.raises(ValueError, match=r"`temperature` \(inf\) must be > 0 \(a finite number\)"):
        fn(s, t, temperature=float("inf"))


def test_evaluate_kl_refuses_an_infinite_temperature(make, data):
    teacher, student = make("qwen2", seed=1), make("qwen2", seed=2)
    with pytest.raises(ValueError, match=r"`temperature` \(inf\) must be > 0 \(a finite number\)"):
        evaluate_kl(student, teacher, data(1), temperature=float("inf"))
    assert evaluate_kl(student, teacher, data(1), temperature=2.0) > 0


@pytest.mark.parametrize("top_k", [None, True, 2.5, 0, "8"])
def test_cache_teacher_topk_refuses_a_top_k_that_is_not_an_int(make, data, tmp_path, top_k):
    teacher = make("qwen2")
    expected = rf"`top_k` \({re.escape(repr(top_k))}\) must be an int >= 1"
    with pytest.raises(ValueError, match=expected):
        cache_teacher_topk(teacher, data(1), tmp_path / "c", top_k=top_k)
    assert not (tmp_path / "c").exists()  # refused before the directory is made


def test_an_attention_mask_shaped_unlike_input_ids_is_refused(make, data):
    model = make("qwen2")
    ids = data(1)[0]["input_ids"]  # (2, 12)
    bad = [{"input_ids": ids, "attention_mask": torch.ones(2, 11, dtype=torch.long)}]
    expected = (
        r"`attention_mask` has shape \(2, 11\) but `input_ids` has shape \(2, 12\): they must "
        r"be equal"
    )
    with pytest.raises(ValueError, match=expected):
        collect_importance(model, bad, layer_loss=False)
    with pytest.raises(ValueError, match=expected):  # the other calibration readers too
        contiguous_block_search(model, bad, 1)
    with pytest.raises(ValueError, match=expected):
        validation_loss(model, bad)
    # rows are compared before `num_samples` cuts the batch
    fewer_rows = [{"input_ids": ids, "attention_mask": torch.ones(1, 12, dtype=torch.long)}]
    with pytest.raises(ValueError, match=r"`attention_mask` has shape \(1, 12\) but"):
        collect_importance(model, fewer_rows, num_samples=1, layer_loss=False)


def test_top_k_checks_read_no_values_of_fake_tensors():
    # leanlm's memory plan runs the loss on fake tensors: the CPU range check read their
    # values (DataDependentOutputException) after the top-k checks were added
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        s = torch.randn(2, 3, 10, requires_grad=True)
        values, indices = torch.topk(torch.randn(2, 3, 10), 4, dim=-1)
        loss = forward_kl(s, (values, indices))
        loss.backward()
    assert loss.shape == ()
