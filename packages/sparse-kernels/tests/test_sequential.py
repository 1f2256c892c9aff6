"""Sequential (layer-by-layer) Wanda and SparseGPT: `sparsify_(..., sequential=True)`."""

import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import sparse_kernels.sparsify as sparsify_module
from leanlm_testing.models import random_batches, tiny_llama
from sparse_kernels import SparsityConfig, remove_masks_, sparsify_
from sparse_kernels.sparsegpt import sparsegpt_prune

# Odd, non-power-of-two sizes: hidden 52, attention width 2 x 12 = 24, MLP 92; in_features
# 52 / 24 / 92 give SparseGPT column blocks of 32 with tails (20, 24, 28).
SHAPE = {
    "hidden_size": 52,
    "intermediate_size": 92,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 12,
    "num_hidden_layers": 3,
}


def _model(seed: int = 0) -> nn.Module:
    return tiny_llama(seed=seed, **SHAPE)


def _qwen2_sliding() -> nn.Module:
    """Qwen2 with layer 0 full attention and layers 1-2 a 4-token sliding window: the model
    hands the layers two different attention masks."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=256,
        max_position_embeddings=64,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        **SHAPE,
    )
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    return Qwen2ForCausalLM(config).eval()


def _batches() -> list[dict[str, torch.Tensor]]:
    """Two batches; the second is left-padded, so layer 0 receives a real attention mask."""
    batches: list[dict[str, torch.Tensor]] = random_batches(256, batches=2, seq_len=12)
    pad = torch.ones_like(batches[1]["input_ids"])
    pad[0, :5] = 0
    batches[1]["attention_mask"] = pad
    return batches


def _hessians_float64(model: nn.Module, layer: nn.Module, batches) -> dict:
    """`2 XᵀX / tokens` (float64) of `layer`'s Linears over full forwards of `model`, over the
    real tokens only (`attention_mask` 1; the Linears' inputs are (batch, seq, features))."""
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    xtx = {n: torch.zeros(m.in_features, m.in_features).double() for n, m in linears.items()}
    tokens = dict.fromkeys(linears, 0)
    real = {}

    def hook(name):
        def fn(module, args):
            x = args[0][real["mask"]].double()
            xtx[name] += x.T @ x
            tokens[name] += x.shape[0]

        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    with torch.no_grad():
        for batch in batches:
            ids = batch["input_ids"]
            real["mask"] = batch.get("attention_mask", torch.ones_like(ids)) == 1
            model(**batch, use_cache=False)
    for h in handles:
        h.remove()
    return {n: (linears[n], 2.0 * xtx[n] / tokens[n]) for n in linears}


def _reference_sparsegpt(model: nn.Module, config: SparsityConfig, batches) -> dict:
    """The sequential algorithm in plain code: layer i's inputs come from full-model forwards
    of the model whose layers < i are already pruned; XᵀX accumulated in float64."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        for name, (linear, hessian) in _hessians_float64(model, layer, batches).items():
            weight, mask = sparsegpt_prune(
                linear.weight.detach(),
                hessian.float(),
                config.parsed,
                sparsity=config.sparsity,
                blocksize=config.sparsegpt_block,
                dampening=config.dampening,
            )
            with torch.no_grad():
                linear.weight.copy_(weight)
            out[f"model.layers.{i}.{name}"] = (mask, weight)
    return out


@pytest.mark.parametrize(
    ("make", "pattern"),
    [(_model, "unstructured"), (_model, "2:4"), (_qwen2_sliding, "unstructured")],
    ids=["llama-unstructured", "llama-2:4", "qwen2_sliding-unstructured"],
)
def test_sequential_sparsegpt_equals_plain_reference(make, pattern):
    config = SparsityConfig(pattern=pattern, method="sparsegpt", sparsity=0.5, sparsegpt_block=32)
    batches = _batches()
    ref = _reference_sparsegpt(make(), config, batches)
    model = make()
    got = sparsify_(model, config, calibration=batches, sequential=True)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)  # stubs removed
    assert set(got) == set(ref)
    assert len(got) == 3 * 7
    for name, (mask, weight) in ref.items():
        assert torch.equal(got[name], mask), name
        linear = model.get_submodule(name)
        torch.testing.assert_close(linear.weight.detach(), weight, atol=1e-5, rtol=1e-4)
    # The one-shot mode scores every layer on dense inputs: same layer 0, different after it.
    oneshot = sparsify_(make(), config, calibration=batches)
    layer0 = [n for n in got if n.startswith("model.layers.0.")]
    assert all(torch.equal(got[n], oneshot[n]) for n in layer0)
    assert any(not torch.equal(got[n], oneshot[n]) for n in got if n not in layer0)


class _SquareTensors(TorchDispatchMode):
    """Weak references to every fp32 (n, n) tensor an op creates, n in `sides` (Hessian-shaped;
    no weight of the test model is square). `live_bytes()` sums those still alive."""

    def __init__(self, sides: set[int]) -> None:
        super().__init__()
        self.sides = sides
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple) else (out,):
            if (
                isinstance(t, torch.Tensor)
                and t.dtype == torch.float32
                and t.dim() == 2
                and t.shape[0] == t.shape[1]
                and t.shape[0] in self.sides
            ):
                self.refs.append(weakref.ref(t))
        return out

    def live_bytes(self) -> int:
        storages = {}
        for ref in self.refs:
            t = ref()
            if t is not None and not isinstance(t, nn.Parameter):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())


@pytest.mark.parametrize("sequential", [True, False])
def test_sequential_holds_one_layers_hessians_at_a_time(monkeypatch, sequential):
    """Each time a Linear is pruned, count the live Hessian-shaped tensors. Sequential: at most
    one layer's Hessians plus the scaled copy handed to the pruner. The one-shot mode holds all
    layers' at once, so the same bound fails for it (which shows the count sees them)."""
    model = _model()
    linears = [m for m in model.model.layers[0].modules() if isinstance(m, nn.Linear)]
    one_layer = sum(4 * m.in_features**2 for m in linears)
    bound = one_layer + max(4 * m.in_features**2 for m in linears)
    sides = {m.in_features for m in linears}
    peaks = []
    tracker = _SquareTensors(sides)

    def spy(weight, hessian, *args, **kwargs):
        peaks.append(tracker.live_bytes())
        return sparsegpt_prune(weight, hessian, *args, **kwargs)

    monkeypatch.setattr(sparsify_module, "sparsegpt_prune", spy)
    config = SparsityConfig(method="sparsegpt", sparsity=0.5)
    with tracker:
        sparsify_(model, config, calibration=_batches(), sequential=sequential)
    assert len(peaks) == 3 * 7
    assert min(peaks) > 0  # the count does see the Hessian being pruned
    if sequential:
        assert max(peaks) <= bound, (max(peaks), bound)
    else:
        assert max(peaks) >= 3 * one_layer > bound


def test_sequential_wanda_equals_one_shot_when_inputs_are_unchanged():
    """Wanda's masks depend on the weights and the norms of their inputs only. Pruning only
    the last layer leaves its inputs as the dense model's, so both modes must agree exactly
    (this checks that layers re-run from layer 0's captured kwargs reproduce the model's
    forward). Pruning every layer changes the inputs of layers 1 and 2: layer 0 still agrees,
    later layers do not."""
    batches = _batches()
    last = SparsityConfig(method="wanda", sparsity=0.5, targets=[r"layers\.2\."])
    seq = sparsify_(_model(), last, calibration=batches, sequential=True)
    one = sparsify_(_model(), last, calibration=batches)
    assert len(seq) == 7
    assert all(torch.equal(seq[n], one[n]) for n in one)

    every = SparsityConfig(method="wanda", sparsity=0.5)
    seq = sparsify_(_model(), every, calibration=batches, sequential=True)
    one = sparsify_(_model(), every, calibration=batches)
    first = [n for n in one if n.startswith("model.layers.0.")]
    assert all(torch.equal(seq[n], one[n]) for n in first)
    assert any(not torch.equal(seq[n], one[n]) for n in one if n not in first)

    # A model already 2:4 by magnitude: Wanda 2:4 keeps the nonzeros, pruning changes no
    # output, and both modes agree on every layer.
    model = _model()
    sparsify_(model, SparsityConfig(pattern="2:4"))
    remove_masks_(model)
    state = model.state_dict()
    cfg = SparsityConfig(pattern="2:4", method="wanda")
    seq = sparsify_(model, cfg, calibration=batches, sequential=True)
    fresh = _model()
    fresh.load_state_dict(state)
    one = sparsify_(fresh, cfg, calibration=batches)
    assert all(torch.equal(seq[n], one[n]) for n in one)


def test_sequential_bad_input_names_the_problem():
    from transformers import OPTConfig, OPTForCausalLM

    opt = OPTForCausalLM(
        OPTConfig(
            vocab_size=64,
            hidden_size=16,
            ffn_dim=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            word_embed_proj_dim=16,
            max_position_embeddings=32,
        )
    )
    cfg = SparsityConfig(method="sparsegpt")
    batches = random_batches(64, batches=1, seq_len=4)
    with pytest.raises(ValueError, match=r"OPTForCausalLM \(model_type='opt'\).*sequential=False"):
        sparsify_(opt, cfg, calibration=batches, sequential=True)
    outside = SparsityConfig(method="wanda", targets=[r"lm_head", r"layers\.0\.mlp"])
    with pytest.raises(ValueError, match=r"\['lm_head'\].*drop them from `targets`"):
        sparsify_(_model(), outside, calibration=_batches(), sequential=True)
    with pytest.raises(ValueError, match="no batch"):
        sparsify_(_model(), cfg, calibration=[], sequential=True)
    with pytest.raises(ValueError, match="dicts of model kwargs"):
        sparsify_(_model(), cfg, calibration=[torch.zeros(2, 4)], sequential=True)
