"""Distillation: loss semantics, the loop's mechanics, and prune -> distill end to end."""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from prune_distill import (
    DistillConfig,
    PruneTarget,
    collect_importance,
    correct_teacher,
    distill,
    evaluate_kl,
    prune,
)


def test_student_equal_to_teacher_has_zero_loss(make, data):
    teacher = make("llama")
    student = copy.deepcopy(teacher)
    result = distill(student, teacher, data(2), DistillConfig(lr=0.0))
    assert result.steps == 2
    assert max(result.losses) < 1e-6
    assert max(result.kl) < 1e-6


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gpt2"])
def test_distillation_lowers_heldout_kl_and_leaves_teacher_alone(arch, make, data, cloned_state):
    teacher = make(arch, initializer_range=0.1).train()  # peaked enough to have a real KL
    before = cloned_state(teacher)
    student = prune(
        teacher,
        collect_importance(teacher, data(2), layer_loss=False),
        PruneTarget(intermediate_size=48, num_hidden_layers=2),
    )
    heldout = data(2, seed=99)
    kl_before = evaluate_kl(student, teacher, heldout)
    result = distill(student, teacher, data(60, batch_size=4, seed=1), DistillConfig(lr=1e-3))
    kl_after = evaluate_kl(student, teacher, heldout)
    assert result.steps == 60
    assert kl_after < 0.8 * kl_before, (kl_before, kl_after)
    assert teacher.training
    assert all(torch.equal(v, before[k]) for k, v in teacher.state_dict().items())
    assert all(p.grad is None for p in teacher.parameters())


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def _padded(batch: dict[str, torch.Tensor], valid: list[int]) -> dict[str, torch.Tensor]:
    """`batch` with right padding: row i keeps its first valid[i] tokens."""
    mask = torch.zeros_like(batch["input_ids"])
    for row, n in enumerate(valid):
        mask[row, :n] = 1
    return {**batch, "attention_mask": mask}


@pytest.mark.parametrize("padded", [False, True])
def test_grad_accumulation_equals_one_big_batch(make, data, padded):
    """With padding, the micro-batches hold 24, 10 and 3 valid tokens: each micro-batch's token
    sums are divided by the group's 37 tokens (the CE by its 34 targets), as one batch would."""
    teacher = make("qwen2", seed=1)
    base = make("qwen2", seed=2)
    micro = data(3, batch_size=2, seed=3)
    if padded:
        micro = [_padded(b, v) for b, v in zip(micro, [[12, 12], [7, 3], [1, 2]], strict=True)]
    big = [{k: torch.cat([b[k] for b in micro]) for k in micro[0]}]

    a, b = copy.deepcopy(base), copy.deepcopy(base)
    cfg = DistillConfig(optimizer=_sgd, max_grad_norm=None, lm_loss_weight=0.5)
    if padded:  # and the hidden-state loss, also a mean over valid tokens
        cfg = dataclasses_replace(cfg, hidden_loss_weight=0.3)
    ra = distill(a, teacher, micro, dataclasses_replace(cfg, grad_accumulation_steps=3))
    rb = distill(b, teacher, big, cfg)
    assert ra.steps == rb.steps == 1
    assert ra.tokens == rb.tokens == (37 if padded else 72)
    for logged in ("losses", "kl", "lm_loss", "hidden_loss"):
        got, want = getattr(ra, logged)[0], getattr(rb, logged)[0]
        assert got == pytest.approx(want, rel=1e-5, nan_ok=True), logged
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-6, msg=name)


def test_a_trailing_partial_group_is_a_smaller_group(make, data):
    teacher = make("qwen2", seed=1)
    base = make("qwen2", seed=2)
    micro = [_padded(b, [9, 4]) for b in data(3, batch_size=2, seed=4)]
    groups = [{k: torch.cat([micro[0][k], micro[1][k]]) for k in micro[0]}, micro[2]]
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    cfg = DistillConfig(optimizer=_sgd, max_grad_norm=None)
    ra = distill(a, teacher, micro, dataclasses_replace(cfg, grad_accumulation_steps=2))
    rb = distill(b, teacher, groups, cfg)
    assert ra.steps == rb.steps == 2
    assert ra.losses == pytest.approx(rb.losses, rel=1e-5)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-6, msg=name)


def dataclasses_replace(cfg: DistillConfig, **changes: Any) -> DistillConfig:
    import dataclasses

    return dataclasses.replace(cfg, **changes)


def test_topk_full_vocab_step_equals_dense_and_options(make, data):
    teacher = make("mistral", seed=1)
    base = make("mistral", seed=2)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    steps: list[int] = []

    def sched(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        s = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: steps.append(i) or 1.0)
        return s

    batches = data(5)
    ra = distill(a, teacher, batches, DistillConfig(top_k=128, max_steps=2, scheduler=sched))
    rb = distill(b, teacher, batches, DistillConfig(max_steps=2, chunk_size=None))
    assert ra.steps == rb.steps == 2
    assert len(steps) == 1 + 2  # LambdaLR evaluates once at construction, then per step
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-6)
    rc = distill(copy.deepcopy(base), teacher, batches, DistillConfig(top_k=8, max_steps=1))
    assert rc.steps == 1


def test_padding_is_excluded(make, data):
    teacher = make("llama", seed=1)
    student = make("llama", seed=2)
    ids = data(1, batch_size=1, seq_len=10)[0]["input_ids"]
    padded = torch.cat([ids, torch.randint(0, 128, (1, 6))], 1)
    mask = torch.ones_like(padded)
    mask[:, 10:] = 0
    kl_a = evaluate_kl(student, teacher, [{"input_ids": ids}])
    kl_b = evaluate_kl(student, teacher, [{"input_ids": padded, "attention_mask": mask}])
    assert kl_a == pytest.approx(kl_b, rel=1e-5)


def test_config_validation():
    with pytest.raises(ValueError, match="`temperature`"):
        DistillConfig(temperature=0.0)
    with pytest.raises(ValueError, match="nothing to train on"):
        DistillConfig(kl_weight=0.0)
    with pytest.raises(ValueError, match="`top_k`"):
        DistillConfig(top_k=0)
    with pytest.raises(ValueError, match="`grad_accumulation_steps`"):
        DistillConfig(grad_accumulation_steps=0)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"max_grad_norm": -1.0}, r"`max_grad_norm` \(-1\.0\) must be a number > 0, or None"),
        ({"max_grad_norm": 0}, r"`max_grad_norm` \(0\) must be a number > 0"),
        ({"max_grad_norm": NAN}, r"`max_grad_norm` \(nan\)"),
        ({"lr": -1e-3}, r"`lr` \(-0\.001\) must be >= 0 \(a finite number\)"),
        ({"lr": NAN}, r"`lr` \(nan\)"),
        ({"lr": True}, r"`lr` \(True\)"),
        ({"weight_decay": -0.1}, r"`weight_decay` \(-0\.1\) must be >= 0 \(a finite number\)"),
        ({"kl_weight": NAN}, r"`kl_weight` \(nan\)"),
        ({"temperature": INF}, r"`temperature` \(inf\) must be > 0 \(a finite number\)"),
        ({"kl_backend": "cuda"}, r"`kl_backend` \('cuda'\) must be one of 'auto', 'torch', 'tri"),
        ({"chunk_size": 0}, r"`chunk_size` \(0\) must be an int >= 1 or None"),
        ({"chunk_size": -5}, r"`chunk_size` \(-5\) must be an int >= 1 or None"),
        ({"chunk_size": 2.5}, r"`chunk_size` \(2\.5\) must be an int"),
        ({"chunk_size": True}, r"`chunk_size` \(True\) must be an int"),
        ({"top_k": 2.5}, r"`top_k` \(2\.5\) must be >= 1 \(an int\) or None"),
        ({"top_k": True}, r"`top_k` \(True\)"),
        ({"grad_accumulation_steps": 1.5}, r"`grad_accumulation_steps` \(1\.5\) must be an int"),
        ({"grad_accumulation_steps": True}, r"`grad_accumulation_steps` \(True\)"),
        ({"max_steps": 2.5}, r"`max_steps` \(2\.5\) must be an int >= 1 or None"),
        ({"max_steps": 0}, r"`max_steps` \(0\) must be an int >= 1 or None"),
        (
            {"top_k": 8, "kl_backend": "triton"},
            r"`kl_backend` 'triton' takes the dense teacher only, but `top_k` is 8",
        ),
        (
            {"chunk_size": None, "kl_backend": "triton"},
            r"`kl_backend` 'triton' conflicts with `chunk_size` None",
        ),
    ],
)
def test_config_rejects_bad_values_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        DistillConfig(**fields)


def test_config_keeps_every_sensible_value():
    for fields in (
        {},
        {"max_grad_norm": None},
        {"max_grad_norm": INF},  # measure the norm, never clip
        {"max_grad_norm": 5},
        {"lr": 0.0},
        {"lr": 1, "weight_decay": 0.1},
        {"temperature": 2},
        {"chunk_size": None},
        {"chunk_size": 1, "kl_backend": "triton"},
        {"top_k": 8, "kl_backend": "torch"},
        {"top_k": 8, "kl_backend": "auto", "chunk_size": None},
        {"max_steps": 3, "grad_accumulation_steps": 4},
    ):
        DistillConfig(**fields)


def test_correct_teacher_checks_its_loop_settings(make):
    with pytest.raises(ValueError, match=r"`max_grad_norm` \(-1\.0\)"):
        correct_teacher(make("llama"), [], steps=1, max_grad_norm=-1.0)
    with pytest.raises(ValueError, match=r"`steps` \(1\.5\) must be an int >= 1"):
        correct_teacher(make("llama"), [], steps=1.5)  # type: ignore[arg-type]


def test_end_to_end_train_prune_distill(make, patterns):
    learnable = partial(patterns, batch_size=8, seq_len=24)
    torch.manual_seed(0)
    teacher = make("llama", num_hidden_layers=4)
    opt = torch.optim.AdamW(teacher.parameters(), lr=3e-3)
    teacher.train()
    for batch in learnable(40, seed=0):  # a few steps: the teacher learns the pattern
        loss = teacher(**batch, labels=batch["input_ids"], use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    teacher.eval()
    heldout = learnable(3, seed=123)
    with torch.no_grad():
        ce = F.cross_entropy(
            teacher(**heldout[0]).logits[:, :-1].reshape(-1, 128),
            heldout[0]["input_ids"][:, 1:].reshape(-1),
        )
    assert ce < 3.0  # well below log(128) = 4.85: the teacher has learned something

    scores = collect_importance(teacher, learnable(4, seed=7))
    target = PruneTarget(
        hidden_size=48, intermediate_size=48, num_attention_heads=4, num_hidden_layers=3
    )
    student = prune(teacher, scores, target)
    kl0 = evaluate_kl(student, teacher, heldout)
    result = distill(student, teacher, learnable(25, seed=1), DistillConfig(lr=3e-3))
    kl1 = evaluate_kl(student, teacher, heldout)
    assert result.kl[-1] < result.kl[0]
    assert kl1 < 0.5 * kl0, (kl0, kl1)


def test_offline_topk_cache_equals_online(make, data, tmp_path):
    from prune_distill import TeacherCache, cache_teacher_topk

    teacher = make("qwen2", seed=1)
    base = make("qwen2", seed=2)
    batches = data(3)
    cache = cache_teacher_topk(teacher, batches, tmp_path / "cache", top_k=128)
    assert len(cache) == 3
    assert len(TeacherCache(tmp_path / "cache")) == 3
    online, offline = copy.deepcopy(base), copy.deepcopy(base)
    # SGD: Adam's normalisation would amplify float-rounding differences of near-zero gradients.
    cfg = DistillConfig(optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    r_on = distill(online, teacher, batches, cfg)
    r_off = distill(offline, None, cache, cfg)
    assert r_off.kl == pytest.approx(r_on.kl, rel=1e-5)
    for pa, pb in zip(online.parameters(), offline.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-6)
    small = cache_teacher_topk(teacher, batches[:1], tmp_path / "k8", top_k=8)
    record = next(iter(small))
    assert record["teacher_topk_values"].shape == (2, 12, 8)
    with pytest.raises(ValueError, match="already holds"):
        cache_teacher_topk(teacher, batches, tmp_path / "k8", top_k=8)
    with pytest.raises(ValueError, match="`teacher` is None"):
        distill(copy.deepcopy(base), None, batches, cfg)


def test_one_step_follows_the_forward_kl_gradient(make, data):
    """One plain-SGD step of `distill` moves the student along -lr * grad of the mean token
    KL(teacher || student), computed here from its definition; the reverse KL's step differs."""
    teacher = make("llama", seed=1, initializer_range=0.2)
    student = make("llama", seed=2, initializer_range=0.2)
    batch = data(1, seed=5)[0]
    lr = 0.5

    def step_with(kl_of) -> torch.Tensor:
        ref = copy.deepcopy(student)
        with torch.no_grad():
            p_t = teacher(**batch).logits.float().log_softmax(-1)
        logp_s = ref(**batch).logits.float().log_softmax(-1)
        loss = kl_of(p_t, logp_s).sum(-1).mean()
        (g,) = torch.autograd.grad(loss, ref.lm_head.weight)
        return student.lm_head.weight.detach() - lr * g

    forward = step_with(lambda lt, ls: lt.exp() * (lt - ls))
    reverse = step_with(lambda lt, ls: ls.exp() * (ls - lt))
    cfg = DistillConfig(
        optimizer=lambda p: torch.optim.SGD(p, lr=lr), max_grad_norm=None, chunk_size=7
    )
    distill(student, teacher, [batch], cfg)
    after = student.lm_head.weight.detach()
    torch.testing.assert_close(after, forward, rtol=1e-4, atol=1e-6)
    assert (after - reverse).abs().max() > 100 * (after - forward).abs().max()
