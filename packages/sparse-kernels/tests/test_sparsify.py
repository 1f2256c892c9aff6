"""sparsify_: targets, methods (magnitude, Wanda, SparseGPT) and masks that hold."""

import io

import pytest
import torch
from torch import nn

from leanlm_testing.models import random_batches, tiny_llama
from optim_adafactor import Adafactor
from optim_came import CAME
from sparse_kernels import (
    SparsityConfig,
    apply_mask_,
    get_mask,
    masks,
    remove_masks_,
    select_targets,
    sparsify_,
    sparsity_report,
)


def test_default_targets_are_decoder_linears_only():
    model = tiny_llama()
    names = list(select_targets(model))
    assert len(names) == 2 * 7
    assert all(n.startswith("model.layers.") for n in names)
    assert "lm_head" not in names
    only_mlp = select_targets(model, [r"mlp\."])
    assert len(only_mlp) == 2 * 3


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
@pytest.mark.parametrize("pattern", ["2:4", "4:8", "unstructured", "block"])
def test_tiny_llama_sparsified_runs_and_pattern_holds(pattern, method):
    model = tiny_llama()
    batches = random_batches(256, batches=2)
    config = SparsityConfig(pattern=pattern, method=method, sparsity=0.6, block_size=16)
    out = sparsify_(model, config, calibration=batches)
    assert set(out) == set(select_targets(model))
    logits = model(**batches[0]).logits
    assert logits.shape == (2, 16, 256)
    assert torch.isfinite(logits).all()
    for name, module in select_targets(model).items():
        w = module.weight
        assert isinstance(module, nn.Linear)
        assert (w[~out[name]] == 0).all(), name
        if pattern in ("2:4", "4:8"):
            n, m = map(int, pattern.split(":"))
            nz = (w != 0).view(w.shape[0], -1, m).sum(-1)
            assert (nz <= n).all()  # exactly n kept; a kept weight may itself be 0
            assert (out[name].view(w.shape[0], -1, m).sum(-1) == n).all()
        else:
            assert int((~out[name]).sum()) > 0
    # embeddings and lm_head untouched
    assert get_mask(model.lm_head) is None


class _OneLinear(nn.Module):
    """One Linear named `blocks.0` (a name the default targets select), called on batch["x"]."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(in_features, out_features, bias=bias)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


def _with_weight(weight: torch.Tensor) -> _OneLinear:
    net = _OneLinear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        net.blocks[0].weight.copy_(weight)
    return net


def test_wanda_picks_by_weight_times_input_norm():
    # weight row [1, 2, 3, 4]; inputs scale feature j by [10, 1, 1, 0.1]:
    # scores |W|·‖X_j‖ ∝ [10, 2, 3, 0.4] -> 2:4 keeps features 0 and 2 (magnitude: 2 and 3).
    net = _with_weight(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    scale = torch.tensor([10.0, 1.0, 1.0, 0.1])
    batches = [{"x": torch.randn(64, 4) * scale} for _ in range(2)]
    m = sparsify_(net, SparsityConfig(pattern="2:4", method="wanda"), calibration=batches)
    assert m["blocks.0"].tolist() == [[True, False, True, False]]
    net2 = _with_weight(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    m2 = sparsify_(net2, SparsityConfig(pattern="2:4", method="magnitude"))
    assert m2["blocks.0"].tolist() == [[False, False, True, True]]


def test_wanda_unstructured_ranks_within_each_output_row_by_default():
    """Wanda (Sun et al.) compares weights within each output row: at 50% every row keeps its 2
    best of 4. Ranked over the layer, the large row would keep everything and the small row
    nothing; that stays available as `granularity="layer"`."""

    weight = torch.tensor([[10.0, 20.0, 30.0, 40.0], [4.0, 1.0, 3.0, 2.0]])
    batches = [{"x": torch.ones(8, 4)}]  # equal input norms: the score order is |W|'s
    masks = {}
    for granularity in (None, "row", "layer"):
        net = _with_weight(weight)
        cfg = SparsityConfig(method="wanda", sparsity=0.5, granularity=granularity)
        masks[granularity] = sparsify_(net, cfg, calibration=batches)["blocks.0"].tolist()
    per_row = [[False, False, True, True], [True, False, True, False]]
    assert masks[None] == masks["row"] == per_row
    assert masks["layer"] == [[True, True, True, True], [False, False, False, False]]
    assert SparsityConfig(method="wanda").granularity == "row"
    assert SparsityConfig(method="magnitude").granularity == "layer"
    assert SparsityConfig(method="sparsegpt").granularity == "layer"
    assert SparsityConfig(method="wanda", granularity="layer").granularity == "layer"


def _correlated_layer(seed: int = 0, rows: int = 48, cols: int = 64, tokens: int = 512):
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=gen) / cols**0.5
    scales = torch.logspace(-1, 1, cols)[torch.randperm(cols, generator=gen)]
    x = (torch.randn(tokens, cols, generator=gen) @ mix) * scales + 0.5 * torch.randn(
        cols, generator=gen
    )
    torch.manual_seed(seed)
    return (
        _OneLinear(cols, rows, bias=True),
        [{"x": x[i : i + 128]} for i in range(0, tokens, 128)],
        x,
    )


@pytest.mark.parametrize("pattern", ["2:4", "unstructured", "block"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sparsegpt_and_wanda_beat_magnitude_on_output_error(pattern, seed):
    errs = {}
    for method in ["magnitude", "wanda", "sparsegpt"]:
        net, batches, x = _correlated_layer(seed)
        ref = net(x).detach()
        cfg = SparsityConfig(pattern=pattern, method=method, sparsity=0.5, block_size=8)
        sparsify_(net, cfg, calibration=batches)
        errs[method] = float((net(x).detach() - ref).square().mean())
    assert errs["sparsegpt"] < errs["wanda"] < errs["magnitude"], errs


def _train(model, opt, batches, steps):
    for step in range(steps):
        batch = batches[step % len(batches)]
        loss = model(**batch, labels=batch["input_ids"]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.SGD(p, lr=1e-1, momentum=0.9, weight_decay=0.01),
        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1),
        lambda p: Adafactor(p, lr=1e-2, relative_step=False, beta1=0.9, weight_decay=0.1),
        lambda p: CAME(p, lr=1e-2, weight_decay=0.1),
    ],
    ids=["adamw", "sgd_momentum", "adam_l2", "adafactor", "came"],
)
def test_masks_hold_through_optimizer_steps_and_state_dict(make_opt, tmp_path):
    model = tiny_llama().train()
    batches = random_batches(256, batches=2, seq_len=8)
    out = sparsify_(model, SparsityConfig(pattern="2:4"))
    before = {n: m.weight.detach().clone() for n, m in select_targets(model).items()}
    opt = make_opt(model.parameters())
    _train(model, opt, batches, 3)
    for name, module in select_targets(model).items():
        w = module.weight.detach()
        assert (w[~out[name]] == 0).all()
        assert not torch.equal(w, before[name])  # it did train
        assert (module.parametrizations.weight.original.grad[~out[name]] == 0).all()
    # save -> load into a freshly sparsified model: same masks, same outputs
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = tiny_llama(seed=1)
    sparsify_(fresh, SparsityConfig(pattern="unstructured", sparsity=0.3))
    fresh.load_state_dict(torch.load(buf))
    for name, mask in masks(fresh).items():
        assert torch.equal(mask, out[name])
    model.eval()
    fresh.eval()
    torch.testing.assert_close(
        fresh(**batches[0]).logits, model(**batches[0]).logits, atol=0, rtol=0
    )
    # and it keeps holding after loading and training on
    opt = make_opt(fresh.parameters())
    _train(fresh.train(), opt, batches, 2)
    for name, module in select_targets(fresh).items():
        assert (module.weight.detach()[~out[name]] == 0).all()


def test_remove_masks_keeps_zeros_and_parameter_identity():
    model = tiny_llama()
    sparsify_(model, SparsityConfig(pattern="unstructured", sparsity=0.7))
    lin = model.model.layers[0].mlp.up_proj
    original = lin.parametrizations.weight.original
    report = sparsity_report(model)
    assert all(abs(v - 0.7) < 1e-3 for v in report.values())
    remove_masks_(model)
    assert isinstance(lin.weight, nn.Parameter)
    assert lin.weight is original
    assert abs(float((lin.weight == 0).float().mean()) - 0.7) < 1e-3
    assert masks(model) == {}


def test_apply_mask_validates_shape_and_replaces():
    lin = nn.Linear(8, 4)
    with pytest.raises(ValueError, match="shape"):
        apply_mask_(lin, torch.ones(8, 4, dtype=torch.bool))
    m1 = torch.rand(4, 8) > 0.5
    apply_mask_(lin, m1)
    m2 = torch.rand(4, 8) > 0.5
    apply_mask_(lin, m2)
    assert torch.equal(get_mask(lin), m2)
    assert (lin.weight[~(m1 & m2)] == 0).all()


def test_errors_name_the_problem():
    model = tiny_llama()
    with pytest.raises(ValueError, match="calibration"):
        sparsify_(model, SparsityConfig(method="wanda"))
    with pytest.raises(ValueError, match="targets"):
        sparsify_(model, SparsityConfig(targets=["nothing_matches"]))
    with pytest.raises(ValueError, match="no batch"):
        sparsify_(model, SparsityConfig(method="wanda"), calibration=[])


@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.7])
def test_sparsegpt_row_granularity_prunes_exactly_per_row(sparsity):
    """granularity="row": every row prunes round(s·in) (here 70 columns in lazy blocks of 32,
    so shares of 32, 32 and 6 columns); the OBS update keeps it ahead of Wanda per row."""
    errs = {}
    for method in ["wanda", "sparsegpt"]:
        net, batches, x = _correlated_layer(0, rows=12, cols=70)
        ref = net(x).detach()
        cfg = SparsityConfig(
            method=method, sparsity=sparsity, granularity="row", sparsegpt_block=32
        )
        mask = sparsify_(net, cfg, calibration=batches)["blocks.0"]
        assert (~mask).sum(1).tolist() == [round(sparsity * 70)] * 12, method
        assert (net.blocks[0].weight[~mask] == 0).all()
        errs[method] = float((net(x).detach() - ref).square().mean())
    assert errs["sparsegpt"] < errs["wanda"], errs


def test_sparsegpt_row_granularity_of_one_row_is_the_layer_ranking():
    from sparse_kernels.config import parse_pattern
    from sparse_kernels.sparsegpt import sparsegpt_prune

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 40, generator=gen) * torch.logspace(-1, 1, 40)
    weight = torch.randn(1, 40, generator=gen)
    hessian = 2 * x.T @ x / 256
    pattern = parse_pattern("unstructured")
    options = {"sparsity": 0.45, "blocksize": 16}
    w_row, m_row = sparsegpt_prune(weight, hessian, pattern, per_row=True, **options)
    w_layer, m_layer = sparsegpt_prune(weight, hessian, pattern, **options)
    assert int((~m_row).sum()) == 18
    assert torch.equal(m_row, m_layer)
    assert torch.equal(w_row, w_layer)
