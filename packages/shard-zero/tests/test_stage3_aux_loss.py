"""Stage 3: a loss term a wrapped module computes in its forward from its own parameters.

MoE routers' load-balancing losses and regularisers are computed inside the module's forward
and stashed on it (`self.aux`); the training loop adds them to the loss. When the module's
output does not depend on that term, its backward can run before the gradient reaches the
module's output (which is what gathers the unit again in backward): it read the freed unit,
and every parameter was NaN after the step, silently (a slice of the weight crashed with
"setStorage ... out of bounds"). World 2 (gloo) against one process on the global batch.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._C._autograd import _top_saved_tensors_default_hooks
from torch.utils.checkpoint import checkpoint

from leanlm_testing import spawn
from leanlm_testing.distributed import single_process_group
from shard_zero import ZeroConfig, full_state_dict, memory_stats, prepare

WIDTH = 16
STEPS = 3


class AuxBody(nn.Module):
    """A layer's body: its output and a loss term that reads its weight after the output."""

    def __init__(self, router: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.router = router

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.tanh(self.lin(h))
        if self.router:  # a router's balance loss from a slice of the weight
            probs = torch.softmax(h @ self.lin.weight[:4].t(), dim=-1)
            return out, 1e-2 * probs.mean(0).square().sum()
        return out, 1e-2 * self.lin.weight.square().sum()  # a regulariser


class AuxLayer(nn.Module):
    """A wrapped layer stashing its body's `aux` term, maybe recomputed inside it (`inner`)."""

    def __init__(self, router: bool, inner: str) -> None:
        super().__init__()
        self.body = AuxBody(router)
        self.inner = inner
        self.aux = torch.zeros(())

    def _plain(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The body as a plain function reading the weight (no module call)."""
        weight = self.body.lin.weight
        return torch.tanh(h @ weight.t() + self.body.lin.bias), 1e-2 * weight.square().sum()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # timm style: an activation checkpoint inside the wrapped module
        if self.inner == "module":
            out, self.aux = checkpoint(self.body, h, use_reentrant=False)
        elif self.inner == "function":
            out, self.aux = checkpoint(self._plain, h, use_reentrant=False)
        elif self.inner == "reentrant":
            out, self.aux = checkpoint(self.body, h, use_reentrant=True)
        else:
            out, self.aux = self.body(h)
        return out


class AuxNet(nn.Module):
    def __init__(self, recompute: bool = False, inner: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, WIDTH)
        self.layers = nn.ModuleList(AuxLayer(i % 2 == 1, inner) for i in range(3))
        self.head = nn.Linear(WIDTH, 2)
        self.recompute = recompute

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False) if self.recompute else layer(h)
        loss = (self.head(h) - y).square().mean()
        return loss + sum(layer.aux for layer in self.layers)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def _train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    rank: int,
    world: int,
    how: str = "",
    gathers: list[int] | None = None,
) -> None:
    per = 8 // world
    for step in range(STEPS):
        x, y = _batch(step)
        # `save_on_cpu` keeps a CPU tensor itself (no copy): it must read the gathered unit
        with torch.autograd.graph.save_on_cpu() if how == "save_on_cpu" else nullcontext():
            loss = model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        if how.endswith("retain"):  # a second backward through the retained graph
            loss.backward(retain_graph=True)
        loss.backward()
        opt.step()
        if gathers is not None:
            comm = memory_stats(model, opt)["communication"]
            gathers.append(comm.get("all_gather", {}).get("calls", 0))
        opt.zero_grad()


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _inner(how: str) -> str:
    """The checkpoint inside each layer: `inner-<kind>[-compile|-retain]` -> kind."""
    return how.split("-")[1] if how.startswith("inner-") else ""


def _reference(how: str) -> dict[str, torch.Tensor]:
    model = AuxNet(inner=_inner(how))
    _train(model, _sgd(list(model.parameters())), 0, 1, how)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank: int, world: int, how: str, want: dict[str, torch.Tensor]) -> None:
    model = AuxNet(recompute=how == "recompute", inner=_inner(how))
    model, opt = prepare(model, _sgd, ZeroConfig(stage=3, min_shard_numel=0))
    run = torch.compile(model, backend="aot_eager") if how.endswith("compile") else model
    gathers: list[int] = []
    _train(run, opt, rank, world, how, gathers)
    got = full_state_dict(model)
    for key, value in want.items():
        err = (got[key] - value).abs().max().item()
        assert err < 1e-5, f"{how}: {key} is {err:.3g} from one process"
    engine = model._shard_zero_engine  # type: ignore[attr-defined]
    assert all(u.full.untyped_storage().nbytes() == 0 for u in engine.units), "not freed"
    # the root and every layer once in forward and once more in each later backward; each
    # layer once per backward (the aux term's backward gathers it early, never twice)
    backwards = 2 if how.endswith("retain") else 1
    assert gathers == [backwards + (1 + backwards) * 3] * STEPS, (how, gathers)
    if how == "eager":  # a forward that raises inside a unit leaves no saved-tensor hooks
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            model.layers[0](torch.zeros(2, WIDTH + 1))
        assert _top_saved_tensors_default_hooks(False) is None


HOW = ["eager", "recompute", "compile", "save_on_cpu"]
INNER = ["inner-module", "inner-function", "inner-reentrant", "inner-module-compile"]
INNER += ["inner-module-retain", "inner-function-retain"]


@pytest.mark.parametrize("how", HOW + INNER)
def test_an_aux_loss_read_after_the_output_trains_as_one_process(tmp_path: Path, how: str) -> None:
    spawn(_worker, how, _reference(how), world_size=2, tmp_path=tmp_path)


def test_a_double_backward_raises_a_clear_error(tmp_path: Path) -> None:
    # before: torch's "setStorage: ... out of bounds for storage of size 0" from the second
    # backward (the first one's end had freed the units its graph reads)
    with single_process_group("cpu", tmp_path):
        model, opt = prepare(AuxNet(), _sgd, ZeroConfig(stage=3, min_shard_numel=0))
        x, y = _batch(0)
        x.requires_grad_(True)
        with pytest.raises(RuntimeError, match=r"stage 3 does not support .*create_graph=True"):
            torch.autograd.grad(model(x, y), x, create_graph=True)
        model(x, y).backward()  # a plain backward still works after it
        opt.step()
        assert all(torch.isfinite(v).all() for v in full_state_dict(model).values())


class SparseLayer(nn.Module):
    """A graph convolution: its forward saves a sparse adjacency for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.stop = False

    def forward(self, h: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        if self.stop:
            raise KeyboardInterrupt  # a Ctrl-C inside a unit's forward
        return torch.tanh(torch.sparse.mm(adj, self.lin(h)))


class Graph(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(SparseLayer() for _ in range(2))

    def forward(self, h: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(h, adj)
        return h.square().mean()


def _graph_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    dense = (torch.rand(5, 5, generator=g) > 0.5).float()
    return torch.randn(5, WIDTH, generator=g), dense.to_sparse()


def test_sparse_saved_tensors_and_an_interrupted_forward(tmp_path: Path) -> None:
    # before: a sparse tensor saved in a unit's forward failed in the hook ("Cannot access
    # storage of SparseTensorImpl"); a KeyboardInterrupt left the hook installed for good
    h, adj = _graph_data()
    ref = Graph()
    opt = _sgd(list(ref.parameters()))
    for _ in range(2):
        ref(h, adj).backward()
        opt.step()
        opt.zero_grad()
    with single_process_group("cpu", tmp_path):
        model, zopt = prepare(Graph(), _sgd, ZeroConfig(stage=3, min_shard_numel=0))
        for _ in range(2):
            model(h, adj).backward()
            zopt.step()
            zopt.zero_grad()
        got = full_state_dict(model)
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-5, msg=key)
        model.layers[1].stop = True
        with pytest.raises(KeyboardInterrupt):
            model(h, adj)
        assert _top_saved_tensors_default_hooks(False) is not None  # left behind
        model.layers[1].stop = False
        model(h, adj).backward()  # the next forward leaves them
        zopt.zero_grad()
        assert _top_saved_tensors_default_hooks(False) is None
