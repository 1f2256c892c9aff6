"""The prepared model and optimizer behave as torch code written for DDP / FSDP2 expects.

World 2 (gloo) against single-process training on the global batch: mixed-dtype parameters at
stages 1-2, `model.zero_grad()` in the loop, optimizer step hooks and LR schedulers,
`model.load_state_dict()` after `prepare`, stage-3 units returning dicts, `model.state_dict()`
at stage 3, and checkpoints that carry the model's buffers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from leanlm_testing import spawn
from shard_zero import (
    ZeroConfig,
    full_state_dict,
    gathered,
    load_checkpoint,
    memory_stats,
    prepare,
    save_checkpoint,
)
from shard_zero._layout import Entry, make_buckets

STEPS = 3


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _batch(step: int, rows: int = 4, cols: int = 8) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(100 + step))


def _mine(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = x.shape[0] // world
    return x[rank * per : (rank + 1) * per]


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for key, value in want.items():
        err = (got[key].float() - value.float()).abs().max().item()
        assert err < 1e-6, f"{what}: {key} is {err:.3g} from single-process training"


# ---------------------------------------------------------------------- models
class Mixed(nn.Module):
    """An fp32 and a bf16 parameter (registered last); the loss separates them."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(8, 8, generator=g))
        self.b = nn.Parameter(torch.randn(8, 8, generator=g).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp32 = torch.tanh(x @ self.a.t()).pow(2).mean()
        return fp32 + (x.to(torch.bfloat16) @ self.b.t()).float().pow(2).mean()


class Block(nn.Module):
    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.as_dict = as_dict

    def forward(self, h: Any) -> Any:
        h = h["h"] if isinstance(h, dict) else h
        out = torch.tanh(self.lin(h))
        return {"h": out, "aux": (out.sum(),)} if self.as_dict else out


class Stack(nn.Module):
    """Wrapped blocks (stage-3 units) between an input layer and a head."""

    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block(as_dict) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: Any = self.inp(x)
        for block in self.blocks:
            h = block(h)
        h = h["h"] if isinstance(h, dict) else h
        return self.head(h).pow(2).mean()


class Normed(nn.Module):
    """A model whose BatchNorm carries running statistics (persistent buffers)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.bn(self.lin(x)))).pow(2).mean()


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, *, clear: str = "opt"
) -> None:
    for step in range(STEPS):
        model(_mine(_batch(step), rank, world)).backward()
        opt.step()
        if clear == "opt":
            opt.zero_grad()
        else:
            model.zero_grad(set_to_none=clear == "model")


def _reference(make: Any, clear: str = "opt") -> dict[str, torch.Tensor]:
    model = make()
    _train(model, _sgd(list(model.parameters())), 0, 1, clear=clear)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------- buckets
def test_buckets_never_mix_dtypes() -> None:
    def entry(name: str, dtype: torch.dtype) -> Entry:
        p = nn.Parameter(torch.zeros(4, 2, dtype=dtype))
        return Entry(name, p, p, True, (4, 2), 0, 2, 2, 2)

    dtypes = [torch.float32, torch.bfloat16, torch.bfloat16, torch.float32]
    buckets = make_buckets([entry(str(i), d) for i, d in enumerate(dtypes)], 1 << 20, 2)
    assert [[e.name for e in b.entries] for b in buckets] == [["0"], ["1", "2"], ["3"]]


# ---------------------------------------------------------------------- training loops
def _mixed(rank: int, world: int, ref: dict[str, torch.Tensor]) -> None:
    for stage in (1, 2):  # an fp32 parameter sharing a gather bucket with a bf16 one stays fp32
        model, opt = prepare(Mixed(), _sgd, ZeroConfig(stage=stage, min_shard_numel=0))
        _train(model, opt, rank, world)
        assert model.a.dtype == torch.float32
        assert model.b.dtype == torch.bfloat16
        full = full_state_dict(model)
        _close(full, {"a": ref["a"]}, f"stage {stage} mixed dtypes, master")
        _close({"a": model.a.detach()}, {"a": ref["a"]}, f"stage {stage} model.a")
        assert torch.equal(model.b.detach(), full["b"].to(torch.bfloat16))


def _model_zero_grad(rank: int, world: int, ref: dict[str, torch.Tensor]) -> None:
    for stage in (1, 2, 3):
        for clear in ("model", "model-zeros"):  # set_to_none True, then False
            model, opt = prepare(Stack(), _sgd, ZeroConfig(stage=stage, min_shard_numel=0))
            _train(model, opt, rank, world, clear=clear)
            if clear == "model":
                assert all(p.grad is None for g in opt.param_groups for p in g["params"])
            _close(full_state_dict(model), ref, f"stage {stage} {clear}.zero_grad()")


def _dict_blocks(rank: int, world: int, ref: dict[str, torch.Tensor]) -> None:
    # stage-3 units returning a dict (tensors nested in it) are gathered again for backward
    model, opt = prepare(Stack(as_dict=True), _sgd, ZeroConfig(stage=3, min_shard_numel=0))
    _train(model, opt, rank, world)
    _close(full_state_dict(model), ref, "stage 3, blocks returning dicts")


LOOPS = {
    "mixed_dtypes": (_mixed, lambda: _reference(Mixed)),
    "model_zero_grad": (_model_zero_grad, lambda: _reference(Stack, clear="model")),
    "stage3_dict_output": (_dict_blocks, lambda: _reference(lambda: Stack(as_dict=True))),
}


@pytest.mark.parametrize("case", sorted(LOOPS))
def test_training_loop_matches_single_process(tmp_path: Path, case: str) -> None:
    worker, reference = LOOPS[case]
    spawn(worker, reference(), world_size=2, tmp_path=tmp_path)


# ---------------------------------------------------------------------- hooks and schedulers
def _hooks(rank: int, world: int) -> None:
    model, opt = prepare(Stack(), _sgd, ZeroConfig(stage=2, min_shard_numel=0))
    calls: list[tuple[str, Any, Any, Any]] = []
    after: list[torch.Tensor] = []

    def record(kind: str) -> Any:
        def hook(o: Any, args: Any, kwargs: Any) -> None:
            # every call, also one for the wrapped optimizer (whose own step runs inside)
            calls.append((kind, args, kwargs, o.param_groups[0]["lr"]))
            if kind == "post" and o is opt:
                after.append(model.head.weight.detach().clone())

        return hook

    handles = [
        opt.register_step_pre_hook(record("pre")),
        opt.register_step_post_hook(record("post")),
        register_optimizer_step_pre_hook(record("global-pre")),
        register_optimizer_step_post_hook(record("global-post")),
    ]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(2):
        model(_mine(_batch(step), rank, world)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        # the post hook ran after the model's parameters were updated
        assert torch.equal(after[-1], model.head.weight.detach())
    # a global hook removed by the wrapped optimizer's own hook stays removed
    removed = register_optimizer_step_pre_hook(record("removed"))
    inner = opt.optimizer.register_step_pre_hook(lambda *_: removed.remove())
    model(_mine(_batch(2), rank, world)).backward()
    opt.step()
    opt.zero_grad()
    inner.remove()
    model(_mine(_batch(3), rank, world)).backward()
    opt.step()
    opt.zero_grad()
    assert [c[0] for c in calls].count("removed") == 1, calls
    calls[:] = [c for c in calls if c[0] != "removed"][:8]
    for handle in handles:
        handle.remove()
    kinds = [c[0] for c in calls]  # global hooks once per step, not again for the wrapped one
    assert kinds == ["global-pre", "pre", "post", "global-post"] * 2, kinds
    assert all(c[1] == (opt,) and c[2] == {} for c in calls), calls
    assert [c[3] for c in calls] == [0.1] * 4 + [0.05] * 4
    assert opt.param_groups[0]["lr"] == 0.025
    # state-dict hooks run too
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "tag": 1})
    assert opt.state_dict()["tag"] == 1


def test_step_hooks_and_lr_scheduler(tmp_path: Path) -> None:
    spawn(_hooks, world_size=2, tmp_path=tmp_path)


# ---------------------------------------------------------------------- state dicts
LOAD_CASES = {  # (stage, param_dtype, offload_optimizer)
    "stages_1_2": [(1, torch.bfloat16, False), (2, torch.bfloat16, False), (2, None, True)],
    "stage_3": [(3, None, False), (3, torch.bfloat16, True)],
}


def _loads(rank: int, world: int, pretrained: dict[str, torch.Tensor], which: str) -> None:
    for stage, dtype, offload in LOAD_CASES[which]:
        what = f"stage {stage} param_dtype {dtype} offload {offload}"
        config = ZeroConfig(
            stage=stage, param_dtype=dtype, offload_optimizer=offload, min_shard_numel=0
        )
        compute = dtype or torch.float32
        model, opt = prepare(Stack(), lambda ps: torch.optim.SGD(ps, lr=0.0), config)
        model.load_state_dict(pretrained)
        model(_mine(_batch(0), rank, world).to(compute)).backward()
        opt.step()  # lr 0: the masters are copied into the model again
        opt.zero_grad()
        _close(full_state_dict(model), pretrained, f"{what}: masters after load + step")
        want = Stack()
        want.load_state_dict(pretrained)
        x = _batch(1).to(compute)
        with torch.no_grad():  # the model computes with the loaded weights
            got, ref = model(x).item(), want.to(compute)(x).item()
        assert abs(got - ref) <= (1e-6 if dtype is None else 0.0), (what, got, ref)
        if stage == 3:
            with pytest.raises(RuntimeError, match="full_state_dict"):
                model.state_dict()
        with pytest.raises(ValueError, match="assign"):
            model.load_state_dict(pretrained, assign=True)


@pytest.mark.parametrize("which", sorted(LOAD_CASES))
def test_load_state_dict_after_prepare(tmp_path: Path, which: str) -> None:
    g = torch.Generator().manual_seed(5)
    pretrained = {k: torch.randn(v.shape, generator=g) for k, v in Stack().state_dict().items()}
    spawn(_loads, pretrained, which, world_size=2, tmp_path=tmp_path)


def _buffers(rank: int, world: int, path: str) -> None:
    config = ZeroConfig(stage=2, min_shard_numel=0)
    model, opt = prepare(Normed(), _sgd, config)
    _train(model, opt, rank, world)
    save_checkpoint(path, model, opt)
    saved = [{k: v.clone() for k, v in model.bn.state_dict().items()}]
    dist.broadcast_object_list(saved, src=0)
    _train(model, opt, rank, world)
    want = full_state_dict(model)
    resumed, ropt = prepare(Normed(), _sgd, config)
    load_checkpoint(path, resumed, ropt)
    for key, value in saved[0].items():  # rank 0's buffers, on every rank
        assert torch.equal(resumed.bn.state_dict()[key], value), key
    _train(resumed, ropt, rank, world)
    got = full_state_dict(resumed)
    if rank == 0:  # rank 0 resumed from its own buffers: bit-equal to the uninterrupted run
        for key, value in want.items():
            assert torch.equal(got[key], value), key


def test_checkpoint_keeps_buffers(tmp_path: Path) -> None:
    spawn(_buffers, str(tmp_path / "ckpt"), world_size=2, tmp_path=tmp_path)


# ---------------------------------------------------------------------- stage 3 at rest
def _at_rest(rank: int, world: int, want: dict[str, torch.Tensor]) -> None:
    for dtype in (None, torch.bfloat16):
        compute = dtype or torch.float32
        model = Stack()
        shapes = {n: p.shape for n, p in model.named_parameters()}
        count = sum(p.numel() for p in model.parameters())
        config = ZeroConfig(stage=3, param_dtype=dtype, min_shard_numel=0)
        model, opt = prepare(model, _sgd, config)
        params = dict(model.named_parameters())
        for step in range(STEPS):
            model(_mine(_batch(step), rank, world).to(compute)).backward()
            opt.step()
            opt.zero_grad()
            # outside forward and backward: the same parameter objects, their shapes, dtype
            # and device, and no data behind them (reads NaN, writes refused or lost)
            assert dict(model.named_parameters()) == params
            assert sum(p.numel() for p in model.parameters()) == count
            assert memory_stats(model)["params"] == 0
            for name, p in model.named_parameters():
                assert (p.shape, p.dtype, p.device) == (shapes[name], compute, torch.device("cpu"))
                assert p.isnan().all(), name
                if p.numel() == 1:  # one element: torch writes it (into the placeholder)
                    continue
                with pytest.raises(RuntimeError, match="single memory location"), torch.no_grad():
                    p.copy_(torch.zeros(p.shape, dtype=compute))
                with pytest.raises(RuntimeError, match="single memory location"):
                    nn.init.normal_(p)
            with torch.no_grad():  # writes torch lets through a placeholder: lost, own element
                model.head.weight.zero_()
                model.head.bias.fill_(3.0)
            assert model.head.weight.eq(0).all()
            assert model.head.bias.eq(3).all()
            others = [p for n, p in model.named_parameters() if not n.startswith("head.")]
            assert all(p.isnan().all() for p in others)
        if dtype is None:  # the writes and reads above changed nothing
            _close(full_state_dict(model), want, "stage 3 after reads and writes at rest")


def test_stage_3_parameters_at_rest_are_nan_placeholders(tmp_path: Path) -> None:
    spawn(_at_rest, _reference(Stack), world_size=2, tmp_path=tmp_path)


# ---------------------------------------------------------------------- gathered()
def _check_blocks_nest_and_keep_pending_units(
    model: nn.Module, opt: Any, x: torch.Tensor, want: dict[str, torch.Tensor]
) -> None:
    """Nested blocks and a forward inside one free nothing (writeback writes values, not the
    NaN placeholders); a backward inside one makes writeback raise; a block between a forward
    and its backward keeps the units that backward needs."""
    with gathered(model), gathered(model, writeback=True), torch.no_grad():
        model(x)
    _close(full_state_dict(model), want, "nested blocks with a forward inside")
    with (
        pytest.raises(RuntimeError, match="a backward inside the block"),
        gathered(model, writeback=True),
    ):
        model(x).backward()
    opt.zero_grad()
    _close(full_state_dict(model), want, "writeback refused after a backward inside")
    loss = model(x)
    with gathered(model):
        pass
    loss.backward()  # the root unit, gathered before the block, is still there
    opt.zero_grad()


def _check_refused_inside_forward(model: nn.Module, opt: Any, x: torch.Tensor) -> None:
    """Inside forward a unit (the root) is gathered already: refused, on every rank."""
    refused: list[str] = []

    def nested(*_: Any) -> None:
        try:
            with gathered(model):
                pass
        except RuntimeError as err:
            refused.append(str(err))

    handle = model.blocks[0].register_forward_pre_hook(nested)
    model(x).backward()
    handle.remove()
    opt.zero_grad()
    assert len(refused) == 1
    assert "outside forward and backward" in refused[0]


def _gathered(rank: int, world: int) -> None:
    x = _batch(9)
    for stage in (3, 2):
        what = f"stage {stage}"
        model, opt = prepare(Stack(), _sgd, ZeroConfig(stage=stage, min_shard_numel=0))
        _train(model, opt, rank, world)
        full = full_state_dict(model)
        with gathered(model):  # the full values, equal to the masters (fp32 compute)
            inside = {n: p.detach().clone() for n, p in model.named_parameters()}
            if stage == 3:  # changed, not written back: the masters keep their values
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(3.0)
        assert inside.keys() == full.keys()
        _close(inside, full, f"{what}: inside gathered()")
        if stage == 3:
            _close(full_state_dict(model), full, f"{what}: after a change without writeback")
            assert all(p.isnan().all() for p in model.blocks.parameters()), what
        with gathered(model, writeback=True), torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        halved = {k: v * 0.5 for k, v in full.items()}
        _close(full_state_dict(model), halved, f"{what}: after writeback")
        plain = Stack()
        plain.load_state_dict(halved)
        with torch.no_grad():  # the next forward computes with the written-back values
            assert abs(model(x).item() - plain(x).item()) < 1e-6, what
        # that forward had no backward: at stage 3 it left the root unit gathered, which is
        # not "inside forward"
        with gathered(model):
            _close(dict(model.named_parameters()), halved, f"{what}: after an eval forward")
        if stage == 3:
            _check_refused_inside_forward(model, opt, x)
            _check_blocks_nest_and_keep_pending_units(model, opt, x, halved)
    model, _ = prepare(Stack(), _sgd, ZeroConfig(stage=3, param_dtype=torch.bfloat16))
    full = full_state_dict(model)
    with gathered(model):  # bf16 compute: the masters rounded once
        for name, p in model.named_parameters():
            assert torch.equal(p, full[name].to(torch.bfloat16)), name
    with pytest.raises(ValueError, match="param_dtype"), gathered(model, writeback=True):
        pass


def test_gathered_gives_full_values_and_writes_back(tmp_path: Path) -> None:
    spawn(_gathered, world_size=2, tmp_path=tmp_path)


# ---------------------------------------------------------------------- tied across units
class CrossTied(Stack):
    """Two wrapped blocks share one weight (a parameter in two stage-3 units)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[2].lin.weight = self.blocks[0].lin.weight


def _cross_tied(rank: int, world: int, want: dict[str, torch.Tensor]) -> None:
    model, opt = prepare(CrossTied(), _sgd, ZeroConfig(stage=3, min_shard_numel=0))
    _train(model, opt, rank, world)
    _close(full_state_dict(model), want, "a weight tied across two stage-3 units")


def test_weight_tied_across_units_trains_as_one_process(tmp_path: Path) -> None:
    # before: the second layer read the first one's freed placeholder (NaN)
    spawn(_cross_tied, _reference(CrossTied), world_size=2, tmp_path=tmp_path)


class RootTied(Stack):
    """A wrapped block's weight tied to a module outside every wrapped one (as a wrapped
    embedding tied to an unwrapped LM head)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp.weight = self.blocks[1].lin.weight


def _root_tied(rank: int, world: int, want: dict[str, torch.Tensor]) -> None:
    model, opt = prepare(RootTied(), _sgd, ZeroConfig(stage=3, min_shard_numel=0))
    _train(model, opt, rank, world)
    _close(full_state_dict(model), want, "a weight tied between a unit and the root")


def test_weight_tied_between_a_unit_and_the_root_trains_as_one_process(tmp_path: Path) -> None:
    # before: the weight went to the block's unit, and `inp` read its freed placeholder (NaN)
    spawn(_root_tied, _reference(RootTied), world_size=2, tmp_path=tmp_path)


# ---------------------------------------------------------------------- torch.compile
def _compiled(rank: int, world: int, want: dict[str, torch.Tensor]) -> None:
    model, opt = prepare(Stack(), _sgd, ZeroConfig(stage=3, min_shard_numel=0))
    compiled = torch.compile(model, backend="aot_eager")  # the hooks run eagerly
    _train(compiled, opt, rank, world)
    _close(full_state_dict(model), want, "torch.compile(model) at stage 3")


def test_compiled_model_at_stage_3_trains_as_one_process(tmp_path: Path) -> None:
    # before: the hooks' `.data` swaps were traced, and backward found a saved tensor modified
    spawn(_compiled, _reference(Stack), world_size=2, tmp_path=tmp_path)


# ---------------------------------------------------------------------- second backward
def _twice(model: nn.Module, opt: Any, rank: int, world: int) -> None:
    """Each step: two forwards, then two backwards (the first retaining its graph again)."""
    for step in range(STEPS):
        x = _mine(_batch(step), rank, world)
        first, second = model(x), model(x * 0.5)
        first.backward(retain_graph=True)
        first.backward()
        second.backward()
        opt.step()
        opt.zero_grad()


def _second_backward(rank: int, world: int, want: dict[str, torch.Tensor]) -> None:
    for stage in (3, 2):
        model, opt = prepare(Stack(), _sgd, ZeroConfig(stage=stage, min_shard_numel=0))
        _twice(model, opt, rank, world)
        _close(full_state_dict(model), want, f"stage {stage}: a second backward")


def test_second_backward_through_one_forward(tmp_path: Path) -> None:
    # before: at stage 3 the first backward's end freed the root unit, and nothing gathered it
    # again for the second ("setStorage ... size 0")
    model = Stack()
    _twice(model, _sgd(list(model.parameters())), 0, 1)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    spawn(_second_backward, want, world_size=2, tmp_path=tmp_path)
