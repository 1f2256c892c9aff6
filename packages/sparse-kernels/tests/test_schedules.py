"""Schedules: sparsity trajectory, masks only grow, sparse-then-dense keeps the optimizer."""

import pytest
import torch

from leanlm_testing.models import random_batches, tiny_llama
from sparse_kernels import SparsityConfig, masks, select_targets, sparsity_report
from sparse_kernels.schedules import GradualPruning, SparseFromStart, SparseThenDense


def _train_step(model, opt, batch):
    loss = model(**batch, labels=batch["input_ids"]).loss
    opt.zero_grad()
    loss.backward()
    opt.step()


def _layer_sparsity(model) -> float:
    report = sparsity_report(model)
    return sum(report.values()) / len(report) if report else 0.0


def test_gradual_cubic_trajectory_and_monotone_masks():
    model = tiny_llama().train()
    batches = random_batches(256, batches=2, seq_len=8)
    sched = GradualPruning(
        model, initial_sparsity=0.1, final_sparsity=0.8, start_step=2, end_step=10, frequency=2
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    expected = {0: 0.0, 1: 0.0, 2: 0.1, 3: 0.1, 10: 0.8, 11: 0.8, 12: 0.8}
    for t in (4, 6, 8):  # s_f + (s_i - s_f)(1 - (t - t0)/(t1 - t0))^3
        expected[t] = expected[t + 1] = 0.8 + (0.1 - 0.8) * (1 - (t - 2) / 8) ** 3
    previous: dict[str, torch.Tensor] = {}
    for step in range(13):
        if step:
            _train_step(model, opt, batches[step % 2])
            sched.step()
        assert sched.step_count == step
        assert sched.sparsity_at(step) == pytest.approx(expected[step])
        actual = _layer_sparsity(model)
        # exact to rounding of round(s * numel) per layer
        assert actual == pytest.approx(expected[step], abs=2e-4), step
        current = masks(model)
        for name, mask in previous.items():
            assert not (current[name] & ~mask).any(), "a pruned weight came back"
        previous = {n: m.clone() for n, m in current.items()}
        for name, module in select_targets(model).items():
            if name in current:
                assert (module.weight.detach()[~current[name]] == 0).all()


def test_gradual_block_pattern_and_validation():
    model = tiny_llama()
    sched = GradualPruning(
        model, final_sparsity=0.5, end_step=4, frequency=1, pattern="block", block_size=16
    )
    for _ in range(4):
        sched.step()
    assert _layer_sparsity(model) == pytest.approx(0.5, abs=0.06)
    with pytest.raises(ValueError, match="N:M"):
        GradualPruning(model, final_sparsity=0.5, end_step=4, pattern="2:4")
    with pytest.raises(ValueError, match="start_step"):
        GradualPruning(model, final_sparsity=0.5, start_step=5, end_step=4)
    with pytest.raises(ValueError, match="final_sparsity"):
        GradualPruning(model, final_sparsity=1.5, end_step=4)


def test_sparse_from_start_holds_and_resumes():
    model = tiny_llama().train()
    batches = random_batches(256, batches=2, seq_len=8)
    sched = SparseFromStart(model, SparsityConfig(pattern="2:4"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    for step in range(3):
        _train_step(model, opt, batches[step % 2])
        sched.step()
        assert _layer_sparsity(model) == pytest.approx(0.5, abs=1e-6)
    assert sched.state_dict() == {"step_count": 3}
    other = SparseFromStart(tiny_llama(), SparsityConfig(pattern="2:4"))
    other.load_state_dict(sched.state_dict())
    assert other.step_count == 3


def test_sparse_then_dense_requires_its_dense_step():
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"`dense_step` \(None\) is required by SparseThenDense"):
        SparseThenDense(model, SparsityConfig(sparsity=0.5), dense_step=None)  # type: ignore[arg-type]
    assert masks(model) == {}  # refused before pruning (before: never went dense)


def test_sparse_then_dense_switches_on_the_same_parameters():
    model = tiny_llama().train()
    batches = random_batches(256, batches=2, seq_len=8)
    sched = SparseThenDense(model, SparsityConfig(sparsity=0.75), dense_step=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tracked = {id(p) for group in opt.param_groups for p in group["params"]}
    for step in range(1, 5):
        _train_step(model, opt, batches[step % 2])
        sched.step()
        if step < 2:
            assert _layer_sparsity(model) == pytest.approx(0.75, abs=1e-3)
            assert sched.sparsity_at(step) == 0.75
        else:
            assert masks(model) == {}
            assert sched.sparsity_at(step) == 0.0
    # after the switch the weights are trained by the same optimizer and fill in
    for module in select_targets(model).values():
        assert id(module.weight) in tracked
        assert float((module.weight == 0).float().mean()) < 0.05


@pytest.mark.parametrize("granularity", ["rows", "ROW", "", "per_row"])
def test_gradual_rejects_unknown_granularity(granularity):
    with pytest.raises(
        ValueError, match=rf"`granularity` \({granularity!r}\) must be 'layer' or 'row'"
    ):
        GradualPruning(tiny_llama(), final_sparsity=0.5, end_step=4, granularity=granularity)


@pytest.mark.parametrize("block_size", [0, -4])
def test_gradual_rejects_block_size_below_one_at_construction(block_size):
    model = tiny_llama()
    with pytest.raises(ValueError, match=rf"`block_size` \({block_size}\) must be >= 1"):
        GradualPruning(
            model, final_sparsity=0.5, pattern="block", block_size=block_size, start_step=5,
            end_step=9,
        )  # fmt: skip
    assert masks(model) == {}


class _TwoLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _run(make_sched, steps, model=None, opt=None, sched=None):
    for step in steps:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def _fresh(make_sched, seed):
    torch.manual_seed(seed)
    model = _TwoLinears()
    sched = make_sched(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), sched


def _assert_resume_is_exact(make_sched, total, cut, schedule_first):
    model, opt, sched = _fresh(make_sched, 0)
    _run(make_sched, range(1, total + 1), model, opt, sched)
    full = model.state_dict()
    model, opt, sched = _fresh(make_sched, 0)
    _run(make_sched, range(1, cut + 1), model, opt, sched)
    ckpt = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
    model, opt, sched = _fresh(make_sched, 1)  # other initial weights and masks
    if schedule_first:
        sched.load_state_dict(ckpt["sched"])
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    if not schedule_first:
        sched.load_state_dict(ckpt["sched"])
    _run(make_sched, range(cut + 1, total + 1), model, opt, sched)
    resumed = model.state_dict()
    assert sorted(resumed) == sorted(full)
    for key, value in full.items():
        assert torch.equal(resumed[key], value), key


@pytest.mark.parametrize("schedule_first", [False, True])
@pytest.mark.parametrize("cut", [2, 4, 6])  # before, at and after dense_step
def test_sparse_then_dense_resumes_exactly_at_any_step(cut, schedule_first):
    def make(model):
        return SparseThenDense(model, SparsityConfig(sparsity=0.75), dense_step=4)

    _assert_resume_is_exact(make, 8, cut, schedule_first)


def test_sparse_then_dense_restored_past_dense_step_goes_dense():
    model = _TwoLinears()
    sched = SparseThenDense(model, SparsityConfig(sparsity=0.75), dense_step=4)
    assert sorted(masks(model)) == ["layers.0", "layers.1"]
    sched.load_state_dict({"step_count": 6})
    assert masks(model) == {}
    sched.step()
    assert sched.step_count == 7
    assert masks(model) == {}


@pytest.mark.parametrize("schedule_first", [False, True])
@pytest.mark.parametrize("cut", [2, 3, 5, 9])  # before, at, after start_step, after end_step
def test_gradual_with_late_start_resumes_exactly(cut, schedule_first):
    def make(model):
        return GradualPruning(
            model, final_sparsity=0.8, start_step=3, end_step=8, frequency=2
        )  # fmt: skip

    _assert_resume_is_exact(make, 10, cut, schedule_first)


def test_gradual_rejects_decreasing_sparsity():
    model = _TwoLinears()
    with pytest.raises(
        ValueError,
        match=r"`initial_sparsity` \(0.9\) must be <= `final_sparsity` \(0.5\): the masks only",
    ):
        GradualPruning(model, initial_sparsity=0.9, final_sparsity=0.5, end_step=4)
    assert masks(model) == {}
