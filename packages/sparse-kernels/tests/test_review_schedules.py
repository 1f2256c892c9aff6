"""Review fixes: `targets` strings, weights no mask covers (MoE experts), resume with the
optimizer built after the model checkpoint is loaded, schedules that remove only their own
masks or whose Linears were replaced, schedule argument checks, atomic `to_block_sparse_`."""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from leanlm_testing.models import tiny_llama
from sparse_kernels import (
    BlockSparseLinear,
    SparsityConfig,
    masks,
    select_targets,
    sparsify_,
    sparsity_report,
    to_block_sparse_,
)
from sparse_kernels.schedules import GradualPruning, SparseFromStart, SparseThenDense

STRING_TARGETS = re.escape(
    "`targets` must be a sequence of regexes, not a single string, got 'mlp': pass ['mlp']"
)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(16, 16)
        self.mlp = nn.Linear(16, 16)


class _Model(nn.Module):
    """One decoder block (attn, mlp) and an `lm_head` outside the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block()])
        self.lm_head = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block = self.layers[0]
        return self.lm_head(block.mlp(torch.tanh(block.attn(x))))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int, width: int = 16) -> None:
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


# 1: a single string as `targets`


def test_single_string_targets_raise_the_config_error_everywhere():
    model = _Model()
    with pytest.raises(TypeError, match=STRING_TARGETS):
        SparsityConfig(targets="mlp")
    with pytest.raises(TypeError, match=STRING_TARGETS):
        select_targets(model, "mlp")
    with pytest.raises(TypeError, match=STRING_TARGETS):
        GradualPruning(model, final_sparsity=0.5, initial_sparsity=0.5, end_step=4, targets="mlp")
    with pytest.raises(TypeError, match=STRING_TARGETS):
        to_block_sparse_(model, block_size=8, sparsity=0.5, targets="mlp", backend="torch")
    # before: each character was a regex ("m", "l", "p"), so lm_head was pruned / replaced
    assert masks(model) == {}
    assert not any(isinstance(m, BlockSparseLinear) for m in model.modules())
    assert list(select_targets(model, ["mlp"])) == ["layers.0.mlp"]


# 2: weights of the targeted blocks that are not nn.Linear weights stay dense, and say so


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 32, 16))  # (experts, 2 * inter, hidden)
        self.down_proj = nn.Parameter(torch.randn(4, 16, 16))


class _MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(16, 16, bias=False)
        self.norm = nn.LayerNorm(16)  # 1-D: not a matrix weight
        self.router = nn.Parameter(torch.randn(4, 16))
        self.experts = _Experts()


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 16)  # outside the blocks: never listed
        self.layers = nn.ModuleList([_MoEBlock(), _MoEBlock()])


# matrix weights per block: q 256, router 64, gate_up 2048, down 1024 -> dense share 3136/3392
MOE_DENSE = [
    "layers.0.router",
    "layers.0.experts.gate_up_proj",
    "layers.0.experts.down_proj",
    "layers.1.router",
    "layers.1.experts.gate_up_proj",
    "layers.1.experts.down_proj",
]
MOE_WARNING = re.escape(
    "prunes nn.Linear modules only: 6 weight Parameter(s) in the targeted decoder blocks are "
    "not nn.Linear weights and stay dense (layers.0.router, layers.0.experts.gate_up_proj, "
    "layers.0.experts.down_proj, layers.1.router, ...), 92.5% of those blocks' matrix weights"
)


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_sparsify_warns_and_reports_the_weights_it_leaves_dense(frozen):
    """Frozen (one-shot pruning of a model with requires_grad off): before the second fix the
    dense experts were neither warned about nor reported."""
    assert f"{3136 / 3392:.1%}" == "92.5%"
    model = _MoE().requires_grad_(not frozen)
    with pytest.warns(UserWarning, match="sparsify_ " + MOE_WARNING) as record:
        sparsify_(model, SparsityConfig(pattern="2:4"))
    assert len(record) == 1
    report = sparsity_report(model)
    # before: only the two q_proj at 0.5, as if the blocks were half sparse
    assert report == {"layers.0.q_proj": 0.5, "layers.1.q_proj": 0.5} | dict.fromkeys(
        MOE_DENSE, 0.0
    )


def test_gradual_pruning_warns_about_the_weights_it_leaves_dense():
    with pytest.warns(UserWarning, match="GradualPruning " + MOE_WARNING):
        GradualPruning(_MoE(), final_sparsity=0.5, start_step=2, end_step=4)


def test_only_linear_blocks_give_no_warning_and_the_same_report():
    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        sparsify_(model, SparsityConfig(pattern="2:4"))
    assert sorted(sparsity_report(model)) == sorted(select_targets(model))


def test_transformers5_mixtral_experts_are_named():
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    model = transformers.MixtralForCausalLM(config)
    dense = [
        n
        for n, p in model.named_parameters()
        if n.startswith("model.layers.") and p.dim() >= 2 and "_proj" in n and "self_attn" not in n
    ]
    assert dense, "transformers 5 (the tested range) stores Mixtral's experts as 3-D tensors"
    with pytest.warns(UserWarning, match=r"sparsify_ prunes nn.Linear modules only") as record:
        sparsify_(model, SparsityConfig(pattern="2:4"))
    message = str(record[0].message)
    assert "model.layers.0.mlp.experts.gate_up_proj" in message
    report = sparsity_report(model)
    for name in dense:  # the 3-D experts are listed as dense
        assert report[name] == 0.0, name
    assert report["model.layers.0.self_attn.q_proj"] == 0.5


# 4: resume with the optimizer built after the model checkpoint is loaded


class _TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(24, 24), nn.Linear(24, 24)])  # with biases

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


Make = Callable[[nn.Module], Any]


def _gradual(model: nn.Module) -> GradualPruning:
    return GradualPruning(model, final_sparsity=0.8, start_step=3, end_step=8, frequency=2)


def _then_dense(model: nn.Module) -> SparseThenDense:
    return SparseThenDense(model, SparsityConfig(sparsity=0.75), dense_step=4)


def _train(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: range) -> None:
    for step in steps:
        _step(model, opt, step, width=24)
        sched.step()


@pytest.mark.parametrize("schedule_first", [False, True])
@pytest.mark.parametrize(
    ("make", "cut"),
    [(_gradual, c) for c in (2, 3, 5, 9)] + [(_then_dense, c) for c in (2, 4, 6)],
)
def test_resume_with_the_optimizer_built_after_loading(make: Make, cut: int, schedule_first: bool):
    torch.manual_seed(0)
    model = _TwoLinears()
    sched = make(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, sched, range(1, cut + 1))
    ckpt = copy.deepcopy((model.state_dict(), sched.state_dict(), opt.state_dict()))
    _train(model, opt, sched, range(cut + 1, 11))
    full = model.state_dict()
    for optimizer_last in (True, False):  # HF Trainer's order, and the README's loop
        torch.manual_seed(1)  # other initial weights and masks
        fresh = _TwoLinears()
        fresh_sched = make(fresh)
        state = copy.deepcopy(ckpt)
        if not optimizer_last:
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        if schedule_first:
            fresh_sched.load_state_dict(state[1])
        fresh.load_state_dict(state[0])
        if not schedule_first:
            fresh_sched.load_state_dict(state[1])
        if optimizer_last:
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        fresh_opt.load_state_dict(state[2])  # before: RuntimeError (weight state -> bias)
        _train(fresh, fresh_opt, fresh_sched, range(cut + 1, 11))
        resumed = fresh.state_dict()
        assert list(resumed) == list(full)
        for key, value in full.items():
            assert torch.equal(resumed[key], value), (optimizer_last, key)


def test_gradual_parameter_order_is_fixed_and_the_dense_phase_is_exact():
    torch.manual_seed(0)
    plain = _TwoLinears()
    model = copy.deepcopy(plain)
    sched = GradualPruning(model, final_sparsity=0.8, start_step=5, end_step=9, frequency=2)
    names = [n for n, _ in model.named_parameters()]
    assert names == [
        "layers.0.bias",
        "layers.0.parametrizations.weight.original",
        "layers.1.bias",
        "layers.1.parametrizations.weight.original",
    ]
    assert all(bool(m.all()) for m in masks(model).values())  # all ones before start_step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(1, 5):  # dense phase: bit for bit a model without a schedule
        _step(model, opt, step, width=24)
        sched.step()
        _step(plain, plain_opt, step, width=24)
        for ours, theirs in zip(model.layers, plain.layers, strict=True):
            assert torch.equal(ours.weight, theirs.weight)
            assert torch.equal(ours.bias, theirs.bias)
    for step in range(5, 10):
        _step(model, opt, step, width=24)
        sched.step()
        assert [n for n, _ in model.named_parameters()] == names
    assert sparsity_report(model) == pytest.approx({"layers.0": 0.8, "layers.1": 0.8}, abs=1e-3)


# 5: SparseThenDense removes only its own masks


def test_sparse_then_dense_removes_only_its_own_masks():
    torch.manual_seed(0)
    model = _Model()
    keep = SparseFromStart(model, SparsityConfig(pattern="2:4", targets=["mlp"]))
    temporary = SparseThenDense(
        model, SparsityConfig(sparsity=0.5, targets=["attn"]), dense_step=2
    )  # fmt: skip
    assert sorted(masks(model)) == ["layers.0.attn", "layers.0.mlp"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        _step(model, opt, step)
        keep.step()
        temporary.step()
    assert sorted(masks(model)) == ["layers.0.mlp"]  # before: [] (the MLP lost its 2:4)
    weight = model.layers[0].mlp.weight.detach().view(16, 4, 4)
    assert ((weight != 0).sum(-1) <= 2).all()
    assert float((model.layers[0].attn.weight == 0).float().mean()) < 0.1  # dense again


# 6: a schedule whose Linear was replaced by to_block_sparse_


def _block_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.ModuleList([nn.Linear(32, 32)]))


def test_sparse_then_dense_refuses_a_replaced_linear():
    model = _block_model()
    sched = SparseThenDense(
        model, SparsityConfig(pattern="block", sparsity=0.75, block_size=8), dense_step=3
    )
    to_block_sparse_(model, block_size=8, backend="torch")
    message = re.escape(
        "SparseThenDense: 0.0 is no longer the nn.Linear this schedule masks (now a "
        "BlockSparseLinear, e.g. replaced by to_block_sparse_), and the schedule still has to "
        "change its mask (removes it at `dense_step` (3), now at step 1)"
    )
    with pytest.raises(RuntimeError, match=message):  # before: never went dense, silently
        sched.step()


def test_gradual_pruning_refuses_a_replaced_linear_until_end_step():
    model = _block_model()
    sched = GradualPruning(
        model, final_sparsity=0.75, end_step=6, frequency=2, pattern="block", block_size=8
    )
    sched.step()
    sched.step()
    to_block_sparse_(model, block_size=8, backend="torch")
    with pytest.raises(RuntimeError, match=r"GradualPruning: 0\.0 is no longer the nn\.Linear .* "
                       r"\(re-masks up to `end_step` \(6\), now at step 3\)"):  # fmt: skip
        sched.step()


def test_converting_after_the_schedule_is_done_is_fine():
    model = _block_model()
    sched = GradualPruning(
        model, final_sparsity=0.75, end_step=2, frequency=1, pattern="block", block_size=8
    )
    sched.step()
    sched.step()
    (layer,) = to_block_sparse_(model, block_size=8, backend="torch").values()
    for _ in range(3):
        sched.step()
    assert layer.density == 0.25
    assert sched.sparsity_at(sched.step_count) == 0.75
    # the SambaNova flow: a fixed block mask, then BlockSparseLinear for the rest of the run
    model = _block_model()
    fixed = SparseFromStart(model, SparsityConfig(pattern="block", sparsity=0.5, block_size=8))
    (layer,) = to_block_sparse_(model, block_size=8, backend="torch").values()
    for _ in range(3):
        fixed.step()
    assert layer.density == 0.5


# 7: schedule arguments


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"end_step": 0.8 * 999}, "`end_step` must be an int, got 799.2"),
        ({"start_step": 99.5, "end_step": 200}, "`start_step` must be an int, got 99.5"),
        ({"frequency": 100.5}, "`frequency` must be an int, got 100.5"),
        ({"pattern": "block", "block_size": 2.5}, "`block_size` must be an int, got 2.5"),
        ({"end_step": True}, "`end_step` must be an int, got True"),
    ],
)
def test_gradual_rejects_non_int_steps(kwargs: dict[str, Any], message: str):
    model = _Model()
    arguments: dict[str, Any] = {"final_sparsity": 0.5, "end_step": 999} | kwargs
    with pytest.raises(TypeError, match=re.escape(message)):
        GradualPruning(model, **arguments)
    assert masks(model) == {}


def test_gradual_rejects_row_granularity_for_blocks():
    message = re.escape(
        "`granularity` ('row') applies to the unstructured pattern only: `pattern` 'block' "
        "ranks whole tiles over the layer"
    )
    with pytest.raises(ValueError, match=message):  # before: silently ignored
        GradualPruning(
            _Model(), final_sparsity=0.5, end_step=4, pattern="block", block_size=8,
            granularity="row",
        )  # fmt: skip


def test_sparse_then_dense_rejects_a_fractional_dense_step():
    model = _Model()
    with pytest.raises(TypeError, match=re.escape("`dense_step` must be an int, got 2.5")):
        SparseThenDense(model, SparsityConfig(sparsity=0.5), dense_step=2.5)  # type: ignore[arg-type]
    assert masks(model) == {}


def test_sparse_from_start_rejects_a_dict_config():
    model = _Model()
    message = re.escape(
        "`config` must be a SparsityConfig, got dict {'pattern': '2:4'}: pass "
        "SparsityConfig(**config) for a dict"
    )
    with pytest.raises(TypeError, match=message):  # before: AttributeError on 'targets'
        SparseFromStart(model, {"pattern": "2:4"})  # type: ignore[arg-type]
    assert masks(model) == {}


# 9: to_block_sparse_ checks every target before it replaces any


def test_to_block_sparse_leaves_the_model_unchanged_on_a_bad_target():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ModuleList([nn.Linear(32, 32) for _ in range(3)]))
    block = SparsityConfig(pattern="block", sparsity=0.5, block_size=8, targets=[r"0\.[01]$"])
    sparsify_(model, block)
    sparsify_(model, SparsityConfig(pattern="2:4", targets=[r"0\.2$"]))  # not whole tiles
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^the mask of 0\.2 is not made of whole 8x8 tiles$"):
        to_block_sparse_(model, block_size=8, backend="torch")
    assert [type(layer).__name__ for layer in model[0]] == ["ParametrizedLinear"] * 3
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())
