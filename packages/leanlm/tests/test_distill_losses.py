"""`[distill] loss` / `beta`: the stage's loss function is prune-distill's divergence, checked.

No pipeline run: the loss functions the trainer calls (`distillation_loss`, and
`cached_distillation_loss` with a stand-in cache) on two tiny Llamas built from the session's
tiny model config, one optimizer step each.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from leanlm.config import ConfigError, DistillConfig
from leanlm.stages.distill import loss_label
from leanlm.train.distill import cached_distillation_loss, distillation_loss
from leanlm.train.model import llama_config
from prune_distill import divergence

VOCAB = 64


@pytest.fixture(scope="module")
def models(tiny_config):
    model = dataclasses.replace(tiny_config().model, tie_word_embeddings=False)
    cfg = llama_config(model, vocab_size=VOCAB, bos_id=1, eos_id=2, pad_id=0)
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    student = LlamaForCausalLM(cfg)
    with torch.no_grad():  # peaked, different distributions (initialised ones are near uniform)
        teacher.lm_head.weight.normal_(0.0, 2.0)
        student.lm_head.weight.normal_(0.0, 2.0)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    return teacher, student, ids


class _Cache:
    """Stands in for `CachedTeacher`: the teacher's top-`k` logits of the batch."""

    def __init__(self, teacher: torch.nn.Module, k: int) -> None:
        self.teacher, self.k = teacher, k

    def lookup(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = torch.topk(self.teacher(input_ids=input_ids).logits, self.k)
        return values, indices


def _expected(student, teacher_logits, ids, cfg):
    """0.75 x divergence (prune-distill's plain reference) + 0.25 x next-token CE."""
    logits = student(input_ids=ids).logits
    div = divergence(
        logits, teacher_logits, loss=cfg.loss, beta=cfg.beta, temperature=2.0, chunk_size=None
    )
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return 0.75 * div + 0.25 * ce


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
def test_a_distill_step_uses_the_configured_loss(loss, models) -> None:
    teacher, student, ids = models
    cfg = DistillConfig(loss=loss, beta=0.3, temperature=2.0, lm_loss_weight=0.25)
    with torch.no_grad():
        dense = teacher(input_ids=ids).logits
        expected = _expected(student, dense, ids, cfg)
    losses = {
        "online": distillation_loss(teacher, cfg),
        "cached, whole vocabulary": cached_distillation_loss(_Cache(teacher, VOCAB), cfg),  # type: ignore[arg-type]
    }
    for where, loss_fn in losses.items():
        student.zero_grad()
        got = loss_fn(student, ids)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5, msg=where)
        got.backward()
        before = student.lm_head.weight.detach().clone()
        torch.optim.SGD(student.parameters(), lr=0.0).step()  # a step runs; weights kept
        assert torch.equal(student.lm_head.weight, before)
        assert all(torch.isfinite(p.grad).all() for p in student.parameters())  # type: ignore[arg-type]
    # the divergences differ, so the checks above tell the losses apart
    others = {k for k in ("forward_kl", "reverse_kl", "jsd") if k != loss}
    with torch.no_grad():
        for other in others:
            alt = _expected(student, dense, ids, DistillConfig(loss=other, beta=0.3))  # type: ignore[arg-type]
            assert not torch.isclose(alt, expected)
    assert {"forward_kl": "KL", "reverse_kl": "reverse KL", "jsd": "JSD (beta=0.3)"}[
        loss
    ] in loss_label(cfg)


def test_jsd_on_cached_top_k_logits(models) -> None:
    teacher, student, ids = models
    cfg = DistillConfig(loss="jsd", beta=0.6, temperature=2.0, top_k=8, teacher="cached")
    with torch.no_grad():
        top = torch.topk(teacher(input_ids=ids).logits, 8)
        got = cached_distillation_loss(_Cache(teacher, 8), cfg)(student, ids)  # type: ignore[arg-type]
        logits = student(input_ids=ids).logits
        ref = divergence(logits, top, loss="jsd", beta=0.6, temperature=2.0, chunk_size=None)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("changes", "key", "words"),
    [
        ({"loss": "reverse_kl", "top_k": 16}, "loss", "needs the teacher's full distribution"),
        (
            {"loss": "reverse_kl", "top_k": 16, "teacher": "cached"},
            "loss",
            "needs the teacher's full distribution",
        ),
        ({"loss": "jsd", "beta": 1.0, "top_k": 16}, "loss", "at `beta` 1 needs"),
        ({"loss": "jsd", "beta": 1.5}, "beta", r"\(1.5\) must be a number in \[0, 1\]"),
        ({"beta": -0.1}, "beta", r"\(-0.1\) must be a number in \[0, 1\]"),
        ({"loss": "kl"}, "loss", r"\('kl'\) must be one of 'forward_kl', 'reverse_kl', 'jsd'"),
    ],
)
def test_bad_loss_settings_name_the_key(changes, key, words) -> None:
    with pytest.raises(ConfigError, match=rf"`(distill\.)?{key}`.*{words}"):
        DistillConfig(**changes)


def test_defaults_keep_the_forward_kl() -> None:
    cfg = DistillConfig()
    assert (cfg.loss, cfg.options.loss) == ("forward_kl", "forward_kl")
    assert DistillConfig(loss="jsd", top_k=16).options.top_k == 16  # JSD is finite on a top-k
