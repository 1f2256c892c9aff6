"""Intermediate hidden-state loss and teacher correction (tiny random models from config)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from prune_distill import (
    DistillConfig,
    HiddenStateLoss,
    PruneTarget,
    cache_teacher_topk,
    collect_importance,
    correct_teacher,
    distill,
    even_layer_map,
    prune,
    pruned_layer_map,
)


@pytest.mark.parametrize("kind", ["cosine", "mse"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hidden_loss_is_zero_for_an_exact_copy(make, data, arch, kind):
    # GPT-2's dropout would make the (training-mode) student differ from the eval-mode teacher.
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    teacher = make(arch, **(no_dropout if arch == "gpt2" else {}))
    student = copy.deepcopy(teacher)
    cfg = DistillConfig(lr=0.0, hidden_loss_weight=1.0, hidden_loss_type=kind)
    result = distill(student, teacher, data(2), cfg)
    assert result.steps == 2
    assert result.projection is None  # equal widths: no map to learn
    # fp32 cosine of identical vectors is 1 up to rounding (~1e-7 per token).
    assert max(result.hidden_loss) < 1e-5
    assert max(result.losses) < 1e-5


def _width_and_depth_students(make, data) -> dict[str, tuple[Any, Any, dict[int, int] | None]]:
    teacher = make("llama", num_hidden_layers=4, initializer_range=0.1)
    scores = collect_importance(teacher, data(2), layer_loss=False)
    width = prune(teacher, scores, PruneTarget(hidden_size=48, intermediate_size=48))
    depth_target = PruneTarget(num_hidden_layers=2)
    depth = prune(teacher, scores, depth_target)
    return {
        "width": (teacher, width, None),
        "depth": (teacher, depth, pruned_layer_map(teacher, scores, depth_target)),
    }


@pytest.mark.parametrize("shape", ["width", "depth"])
def test_hidden_loss_decreases_while_distilling(make, data, cloned_state, shape):
    torch.manual_seed(0)
    teacher, student, _ = _width_and_depth_students(make, data)[shape]
    before = cloned_state(teacher)
    # The hidden term alone (default even map: depth 2 of 4 -> {0: 1, 1: 3}), so its decrease
    # is not masked by the KL pulling the other way on a random teacher; two batches seen ten
    # times each (on fresh random tokens 20 steps do not generalise).
    cfg = DistillConfig(lr=3e-3, kl_weight=0.0, hidden_loss_weight=2.0)
    result = distill(student, teacher, data(2, batch_size=4, seed=1) * 10, cfg)
    assert result.steps == 20
    first, last = sum(result.hidden_loss[:2]) / 2, sum(result.hidden_loss[-2:]) / 2
    # Observed: width 0.96 -> 0.28, depth 0.35 -> 0.08 (mean of the first / last two steps).
    assert last < 0.5 * first, (first, last)
    assert all(torch.equal(v, before[k]) for k, v in teacher.state_dict().items())
    assert all(p.grad is None for p in teacher.parameters())
    # The KL is still measured (a teacher is there) and the total is the weighted hidden term.
    assert all(k > 0 for k in result.kl)
    assert result.losses == pytest.approx([2.0 * h for h in result.hidden_loss], rel=1e-5)


def test_kept_layer_map_of_a_depth_pruned_copy_starts_at_zero(make, data):
    teacher = make("llama", num_hidden_layers=4)
    scores = collect_importance(teacher, data(1), layer_loss=False)
    target = PruneTarget(drop_layers=(2, 3))  # keeps 0, 1: the student's last layer is inner
    student = prune(teacher, scores, target)
    cfg = DistillConfig(
        lr=0.0, hidden_loss_weight=1.0, hidden_layer_map=pruned_layer_map(teacher, scores, target)
    )
    result = distill(student, teacher, data(1), cfg)
    # Both sides compared after the final norm: identical layers on identical inputs.
    assert result.hidden_loss[0] < 1e-5


def test_projection_is_trained_with_the_student(make, data):
    torch.manual_seed(0)
    teacher, student, _ = _width_and_depth_students(make, data)["width"]
    seen: dict[str, Any] = {}

    def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        seen["params"] = list(params)
        seen["projection"] = params[-1].detach().clone()
        return torch.optim.AdamW(params, lr=1e-2)

    cfg = DistillConfig(optimizer=adamw, hidden_loss_weight=1.0)
    result = distill(student, teacher, data(3), cfg)
    proj = result.projection
    assert proj is not None
    assert proj.weight.shape == (64, 48)  # student width 48 -> teacher width 64
    assert any(p is proj.weight for p in seen["params"])
    assert seen["projection"].shape == proj.weight.shape
    assert not torch.equal(seen["projection"], proj.weight)  # updated by the optimizer
    assert proj.weight.grad is None  # gradients cleared at the end


def _projected_loss(seed: int | None) -> HiddenStateLoss:
    """One layer pair, student width 48 projected to the teacher's 64 (seeded with `seed`)."""
    return HiddenStateLoss(
        {0: 0},
        student_layers=1,
        teacher_layers=1,
        student_hidden_size=48,
        teacher_hidden_size=64,
        seed=seed,
    )


def test_seeded_projection_does_not_depend_on_the_global_rng():
    def projection(global_seed: int, seed: int | None) -> torch.Tensor:
        torch.manual_seed(global_seed)
        loss = _projected_loss(seed)
        assert loss.projection is not None
        return loss.projection.weight.detach().clone()

    torch.manual_seed(11)
    rng = torch.get_rng_state()
    a = _projected_loss(3).projection
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG neither read nor advanced
    assert a is not None
    assert torch.equal(projection(0, 3), a.weight)
    assert torch.equal(projection(1, 3), a.weight)
    assert not torch.equal(projection(0, 4), a.weight)
    # nn.Linear's distribution, U(-1/sqrt(48), 1/sqrt(48)), spread over the range
    bound = 48**-0.5
    assert a.weight.abs().max() <= bound
    assert a.weight.abs().max() > 0.95 * bound
    assert abs(a.weight.std().item() - bound / 3**0.5) < 0.05 * bound
    # unseeded: nn.Linear's own draw from the global RNG, as before
    torch.manual_seed(5)
    expected = torch.nn.Linear(48, 64, bias=False).weight
    assert torch.equal(projection(5, None), expected)
    assert not torch.equal(projection(6, None), expected)


def test_distill_with_a_projection_seed_is_reproducible(make, data, cloned_state):
    torch.manual_seed(0)
    teacher, student, _ = _width_and_depth_students(make, data)["width"]
    batches = data(3)

    def run(global_seed: int, seed: int | None) -> tuple[Any, dict[str, torch.Tensor]]:
        torch.manual_seed(global_seed)  # as if the process had run something else before
        copy_ = copy.deepcopy(student)
        cfg = DistillConfig(lr=1e-2, hidden_loss_weight=1.0, hidden_projection_seed=seed)
        result = distill(copy_, teacher, batches, cfg)
        assert result.projection is not None
        return result, {**cloned_state(copy_), "projection": result.projection.weight.detach()}

    first, first_state = run(0, seed=7)
    second, second_state = run(1, seed=7)
    assert first.losses == second.losses
    assert first.hidden_loss == second.hidden_loss
    assert first_state.keys() == second_state.keys()
    for name, value in first_state.items():
        assert torch.equal(second_state[name], value), name
    # without a seed the projection, and so the whole run, follows the global RNG
    unseeded, unseeded_state = run(1, seed=None)
    assert unseeded.hidden_loss[0] != first.hidden_loss[0]
    assert not torch.equal(unseeded_state["projection"], first_state["projection"])


def test_layer_maps():
    assert even_layer_map(2, 4) == {0: 1, 1: 3}
    assert even_layer_map(3, 4) == {0: 0, 1: 1, 2: 3}
    assert even_layer_map(3, 3) == {0: 0, 1: 1, 2: 2}
    assert even_layer_map(1, 5) == {0: 4}
    with pytest.raises(ValueError, match="`student_layers`"):
        even_layer_map(0, 4)


def test_default_map_is_even_and_pruned_map_names_the_kept_layers(make, data):
    teacher = make("llama", num_hidden_layers=4)
    scores = collect_importance(teacher, data(1), layer_loss=False)
    target = PruneTarget(drop_layers=(1,))
    assert pruned_layer_map(teacher, scores, target) == {0: 0, 1: 2, 2: 3}
    by_metric = PruneTarget(num_hidden_layers=2)
    layer_map = pruned_layer_map(teacher, scores, by_metric)
    student = prune(teacher, scores, by_metric)
    assert sorted(layer_map) == [0, 1]
    for s, t in layer_map.items():  # each student layer is a copy of the mapped teacher layer
        torch.testing.assert_close(
            student.model.layers[s].mlp.down_proj.weight,
            teacher.model.layers[t].mlp.down_proj.weight,
            rtol=0,
            atol=0,
        )
    loss = HiddenStateLoss.between(student, teacher)
    assert loss.pairs == ((0, 1), (1, 3))  # no map given: even spread, last onto last


def test_bad_layer_maps_and_unsupported_modes_raise(make, data, tmp_path):
    teacher = make("llama")
    student = copy.deepcopy(teacher)
    with pytest.raises(ValueError, match="`hidden_layer_map`"):
        DistillConfig(hidden_loss_weight=1.0, hidden_layer_map={-1: 0})
    with pytest.raises(ValueError, match="`hidden_layer_map`"):
        DistillConfig(hidden_loss_weight=1.0, hidden_layer_map={})
    with pytest.raises(ValueError, match="`hidden_loss_weight`"):
        DistillConfig(hidden_loss_weight=-1.0)
    with pytest.raises(ValueError, match="`hidden_loss_type`"):
        DistillConfig(hidden_loss_weight=1.0, hidden_loss_type="l1")  # type: ignore[arg-type]
    for bad in ({0: 3}, {3: 0}):  # 3-layer models: indices 0..2
        cfg = DistillConfig(hidden_loss_weight=1.0, hidden_layer_map=bad)
        with pytest.raises(ValueError, match=r"out-of-range entries .*\[0, 3\)"):
            distill(student, teacher, data(1), cfg)
    cfg = DistillConfig(hidden_loss_weight=1.0)
    with pytest.raises(ValueError, match="needs a teacher model"):
        distill(student, None, data(1), cfg)
    cache = cache_teacher_topk(teacher, data(1), tmp_path / "cache", top_k=8)
    with pytest.raises(ValueError, match="offline mode"):
        distill(student, teacher, cache, cfg)
    assert all(p.grad is None for p in student.parameters())


def _lm_loss(model: Any, batches: list[dict[str, torch.Tensor]]) -> float:
    with torch.no_grad():
        losses = [
            F.cross_entropy(
                model(**b).logits[:, :-1].reshape(-1, 128), b["input_ids"][:, 1:].reshape(-1)
            )
            for b in batches
        ]
    return float(torch.stack(losses).mean())


def test_teacher_correction_lowers_lm_loss_and_leaves_the_input_alone(make, cloned_state, patterns):
    torch.manual_seed(0)
    teacher = make("llama").train().requires_grad_(False)  # frozen, as a distillation teacher
    before = cloned_state(teacher)
    batches = patterns(12, seed=0, batch_size=4, seq_len=16)
    corrected = correct_teacher(teacher, batches, steps=12, lr=3e-3)
    assert corrected is not teacher
    assert not corrected.training
    assert all(not p.requires_grad for p in corrected.parameters())  # flags as the input's
    assert teacher.training
    assert all(torch.equal(v, before[k]) for k, v in teacher.state_dict().items())
    assert all(p.grad is None for p in teacher.parameters())
    loss_before, loss_after = _lm_loss(teacher.eval(), batches), _lm_loss(corrected, batches)
    # Observed 4.87 -> 4.37 after 12 AdamW steps at lr 3e-3 on learnable sequences.
    assert loss_after < 0.95 * loss_before, (loss_before, loss_after)
    with pytest.raises(ValueError, match="`steps`"):
        correct_teacher(teacher, batches, steps=0)


def test_teacher_correction_then_distill(make, data):
    torch.manual_seed(0)
    teacher = make("qwen2")
    corrected = correct_teacher(teacher, data(2), steps=1, lr=1e-3)
    student = copy.deepcopy(teacher)
    result = distill(student, corrected, data(2), DistillConfig(lr=0.0))
    assert result.steps == 2
    assert min(result.kl) > 0  # the corrected teacher differs from the original


class _ClippingSGD(torch.optim.SGD):
    """SGD over an engine's own copies of the parameters (written back to the model after each
    step), with the engine-style `clip_grad_norm_`."""

    def __init__(self, copies: dict[str, torch.Tensor], model: torch.nn.Module, lr: float) -> None:
        super().__init__(list(copies.values()), lr=lr)
        self.copies, self.model = copies, model
        self.clipped: list[float] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        super().step(closure)
        for name, copy_ in self.copies.items():
            self.model.get_parameter(name).copy_(copy_)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        self.clipped.append(max_norm)
        return torch.nn.utils.clip_grad_norm_(self.copies.values(), max_norm)


def _keep_gradients_elsewhere(student: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient moves into a copy on the side (as shard-zero's buckets take it).

    Returns the side copies (one per parameter, each with its gradient in `.grad`), so an
    optimizer over them is what an engine's own optimizer over its shards is.
    """
    copies = {n: p.detach().clone() for n, p in student.named_parameters()}

    def hook(name: str, p: torch.Tensor) -> None:
        side = copies[name]
        side.grad = p.grad if side.grad is None else side.grad + p.grad
        p.grad = None

    for name, p in student.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: hook(name, p))
    return copies


def test_a_student_whose_gradients_are_kept_elsewhere_is_refused(make, data):
    """Before: the default AdamW over `student.parameters()` stepped nothing (no `.grad`), the
    losses looked normal and the weights did not move (shard-zero's `prepare`, review finding)."""
    teacher = make("llama")
    student = copy.deepcopy(teacher)
    _keep_gradients_elsewhere(student)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    with pytest.raises(RuntimeError, match=r"no parameter of `student` received a gradient"):
        distill(student, teacher, data(2), DistillConfig(lr=1e-2))
    for n, p in student.named_parameters():
        assert torch.equal(p, before[n]), n


def test_an_engine_optimizer_clips_through_its_own_clip_grad_norm(make, data):
    """Before: `max_grad_norm` clipped `student.parameters()`, which hold no gradient under such an
    engine, so nothing was clipped (7e-2 off one process under shard-zero, review finding)."""
    teacher = make("llama", initializer_range=0.1)
    student = copy.deepcopy(teacher)
    for p in student.parameters():  # a student unlike its teacher: gradients worth clipping
        p.data.add_(0.05 * torch.randn_like(p))
    plain = copy.deepcopy(student)
    start = {n: p.detach().clone() for n, p in student.named_parameters()}
    copies = _keep_gradients_elsewhere(student)
    engine = _ClippingSGD(copies, student, lr=0.5)
    cfg = DistillConfig(max_grad_norm=1e-3, optimizer=lambda params: engine)
    distill(student, teacher, data(2), cfg)
    reference = DistillConfig(max_grad_norm=1e-3, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    distill(plain, teacher, data(2), reference)
    assert engine.clipped == [1e-3, 1e-3]
    moved = 0.0
    for (n, p), q in zip(plain.named_parameters(), student.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)
        moved = max(moved, float((q - start[n]).abs().max().detach()))
    assert 0 < moved <= 2 * 0.5 * 1e-3  # two clipped SGD steps: |Δ| <= lr * max_norm each


def test_with_a_hidden_projection_gradients_kept_elsewhere_are_still_refused(make, data):
    """Before: the projection (width-pruned student) got a gradient, so the check passed while
    no student weight moved (review of the first fix, with shard-zero: 0 of 21 tensors)."""
    teacher, student, _ = _width_and_depth_students(make, data)["width"]
    _keep_gradients_elsewhere(student)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    cfg = DistillConfig(lr=1e-2, hidden_loss_weight=1.0)
    with pytest.raises(RuntimeError, match=r"no parameter of `student` received a gradient"):
        distill(student, teacher, data(2), cfg)
    for n, p in student.named_parameters():
        assert torch.equal(p, before[n]), n


def test_an_optimizer_without_the_hidden_projection_is_refused(make, data):
    """An engine's optimizer holds its shards, not the projection `distill` creates: before, the
    projection was never stepped and its gradient grew every step, unclipped."""
    teacher, student, _ = _width_and_depth_students(make, data)["width"]
    engine = torch.optim.SGD(list(student.parameters()), lr=0.1)
    cfg = DistillConfig(hidden_loss_weight=1.0, optimizer=lambda params: engine)
    with pytest.raises(ValueError, match=r"hidden-state projection .* not among the parameters"):
        distill(student, teacher, data(2), cfg)
    # equal widths: no projection, the same optimizer trains
    same = copy.deepcopy(teacher)
    engine = torch.optim.SGD(list(same.parameters()), lr=0.1)
    cfg = DistillConfig(hidden_loss_weight=1.0, optimizer=lambda params: engine)
    assert distill(same, teacher, data(2), cfg).projection is None
