"""Buffers on the model's device, the collective timeout, and clear errors when ranks diverge.

Divergence (a rank that skips a stage-3 unit, or runs an extra forward/backward) must raise a
`RuntimeError` that names the likely cause, on the ranks involved, instead of hanging or pairing
unrelated collectives. The timeout checks assert gloo's own "3000ms" in the message (the group
really has the configured timeout), never wall-clock time.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from leanlm_testing import spawn
from leanlm_testing.distributed import CPU_AND_CUDA, single_process_group
from shard_zero import ZeroConfig, full_state_dict, load_checkpoint, prepare, save_checkpoint
from shard_zero._api import engine_of
from shard_zero._shards import model_device

TIMEOUT = 3.0  # seconds: long enough for a loaded 2-core machine, short enough for a test
WIDTH = 24


class Stack(nn.Module):
    """An input layer, `depth` same-size wrapped layers (stage-3 units) and a head."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(depth))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, skip: tuple[int, ...] = ()) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for i, layer in enumerate(self.layers):
            if i not in skip:
                h = torch.tanh(layer(h))
        loss: torch.Tensor = self.head(h).pow(2).mean()
        return loss


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _data(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to(device)


# ---------------------------------------------------------------------- configuration


def test_timeout_and_flag_validation() -> None:
    assert ZeroConfig(timeout=5).timeout_delta == datetime.timedelta(seconds=5)
    assert ZeroConfig(timeout=0.5).timeout_delta == datetime.timedelta(milliseconds=500)
    delta = datetime.timedelta(minutes=2)
    assert ZeroConfig(timeout=delta).timeout_delta == delta
    assert ZeroConfig().timeout_delta is None
    for bad in (0, -1.0, float("nan"), float("inf"), datetime.timedelta(0)):
        with pytest.raises(ValueError, match="`timeout`"):
            ZeroConfig(timeout=bad)
    for wrong in (True, "30", [1]):
        with pytest.raises(TypeError, match="`timeout`"):
            ZeroConfig(timeout=wrong)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`check_consistency`"):
        ZeroConfig(check_consistency=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`prefetch`"):
        ZeroConfig(prefetch=None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- device placement


def test_parameters_on_two_devices_are_rejected() -> None:
    model = Stack()
    model.head.to("meta")
    with pytest.raises(ValueError, match="one device, got \\['cpu', 'meta'\\]"):
        model_device(model)
    assert model_device(Stack()) == torch.device("cpu")
    assert model_device(nn.ReLU()) == torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_float64_and_complex_parameters_are_refused(tmp_path: Path, dtype: torch.dtype) -> None:
    # fp32 masters trained a float64 model in fp32 and dropped a complex one's imaginary part,
    # silently (plain torch and DDP keep both dtypes)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].weight = nn.Parameter(torch.randn(2, 4, dtype=dtype))
    with single_process_group("cpu", tmp_path):
        for stage in (1, 3):
            with pytest.raises(TypeError, match=f"parameter '1.weight' is {dtype}: shard-zero"):
                prepare(model, lambda ps: torch.optim.SGD(ps, lr=0.1), ZeroConfig(stage=stage))
        model[1].requires_grad_(False)  # frozen: kept as it is, replicated
        prepare(model, lambda ps: torch.optim.SGD(ps, lr=0.1), ZeroConfig(stage=1))
        assert model[1].weight.dtype == dtype


class Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.convs = nn.ModuleList([nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)])
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = torch.relu(conv(x))
        return self.fc(x.mean((2, 3)))


def _conv_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)
    return x, torch.randint(0, 4, (4,), generator=g)


def _train_convs(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    for _ in range(3):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _channels_last(rank: int, world: int, want: dict[str, torch.Tensor]) -> None:
    x, y = _conv_batch()
    for stage in (1, 2, 3):
        model = Convs().to(memory_format=torch.channels_last)
        config = ZeroConfig(stage=stage, min_shard_numel=0)
        model, opt = prepare(model, lambda ps: torch.optim.SGD(ps, lr=0.1), config)
        _train_convs(model, opt, x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
        got = full_state_dict(model)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-5, msg=key)


def test_a_channels_last_model_trains_as_one_process(tmp_path: Path) -> None:
    # before: stages 1-2 at world 2 failed in the first step's parameter gather ("view size is
    # not compatible"), after the optimizer had updated each rank's own rows
    model = Convs().to(memory_format=torch.channels_last)
    _train_convs(model, torch.optim.SGD(model.parameters(), lr=0.1), *_conv_batch())
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    spawn(_channels_last, want, world_size=2, tmp_path=tmp_path)


class _Noisy(torch.optim.SGD):
    """SGD plus noise from a seed drawn at construction (as stochastic rounding draws one).

    The noise is a function of (seed, step), and both are in the state dict beside `state`
    and `param_groups` (as optim-came's stochastic-rounding seed is).
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, lr=0.1)
        self.seed = int(torch.randint(0, 2**62, ()))
        self.steps = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        super().step(closure)
        self.steps += 1
        noise = torch.Generator().manual_seed(self.seed + self.steps)
        for p in self.param_groups[0]["params"]:
            p.add_(torch.randn(p.shape, generator=noise), alpha=1e-2)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "noise": {"seed": self.seed, "steps": self.steps}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.seed, self.steps = state_dict["noise"]["seed"], state_dict["noise"]["steps"]


def _seeded_per_rank(rank: int, world: int, want: dict[str, torch.Tensor]) -> None:
    x = _data()
    for stage in (2, 3):
        model = Stack()
        torch.manual_seed(100 + rank)  # a per-rank stream (dropout, data order)
        mine = torch.get_rng_state()
        config = ZeroConfig(stage=stage, min_shard_numel=10**6)  # every parameter replicated
        model, opt = prepare(model, _Noisy, config)
        # rank 0 drew from its own stream, as one process; the others from rank 0's, and got
        # their own stream back untouched
        if rank > 0:
            assert torch.equal(torch.get_rng_state(), mine)
        seeds = [0] * world
        dist.all_gather_object(seeds, opt.optimizer.seed)
        assert seeds == [want["seed"].tolist()] * world, seeds
        for _ in range(2):
            model(x[2 * rank : 2 * rank + 2]).backward()
            opt.step()
            opt.zero_grad()
        got = full_state_dict(model)
        for key, value in got.items():  # each rank's own copy, not only rank 0's
            theirs = [torch.empty(0)] * world
            dist.all_gather_object(theirs, value)
            for r in range(world):
                torch.testing.assert_close(theirs[r], want[key], atol=1e-6, rtol=1e-5)


def _resumed_elsewhere(rank: int, world: int, want: dict[str, torch.Tensor], ckpt: str) -> None:
    x = _data()
    model = Stack()  # (seeds itself)
    torch.manual_seed(100 + rank)
    model, opt = prepare(model, _Noisy, ZeroConfig(stage=2, min_shard_numel=10**6))
    for _ in range(2):
        model(x[2 * rank : 2 * rank + 2]).backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(ckpt, model, opt)
    model = Stack()
    torch.manual_seed(999 + rank)  # a resume script that draws otherwise before `prepare`
    model, opt = prepare(model, _Noisy, ZeroConfig(stage=2, min_shard_numel=10**6))
    load_checkpoint(ckpt, model, opt)
    assert (opt.optimizer.seed, opt.optimizer.steps) == (want["seed"].tolist(), 2)
    for _ in range(2):
        model(x[2 * rank : 2 * rank + 2]).backward()
        opt.step()
        opt.zero_grad()
    got = full_state_dict(model)
    for key, value in got.items():
        torch.testing.assert_close(value, want[key], atol=1e-6, rtol=1e-5, msg=key)


def test_a_resume_restores_the_optimizers_own_state_dict_entries(tmp_path: Path) -> None:
    # before: the checkpoint kept `state` and `param_groups` only, so a seed beside them (the
    # stochastic-rounding seed of optim-came / optim-adafactor) came from the resuming
    # process's random stream: the run continued 0.0174 away after 3 steps
    model = Stack()
    torch.manual_seed(100)
    opt = _Noisy(list(model.parameters()))
    for _ in range(4):
        model(_data()).backward()
        opt.step()
        opt.zero_grad()
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    want["seed"] = torch.tensor(opt.seed)
    ckpt = str(tmp_path / "ckpt")
    spawn(_resumed_elsewhere, want, ckpt, world_size=2, tmp_path=tmp_path)


def test_what_the_optimizer_draws_at_construction_is_alike_on_every_rank(
    tmp_path: Path,
) -> None:
    # before: `make_optimizer` drew from each rank's own stream, so with per-rank seeds the
    # replicated parameters, which each rank steps on its own copy, drifted apart
    model = Stack()
    torch.manual_seed(100)  # rank 0's stream
    opt = _Noisy(list(model.parameters()))
    for _ in range(2):
        model(_data()).backward()
        opt.step()
        opt.zero_grad()
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    want["seed"] = torch.tensor(opt.seed)
    spawn(_seeded_per_rank, want, world_size=2, tmp_path=tmp_path)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_changing_parameters_after_prepare_raises(tmp_path: Path, stage: int) -> None:
    """A cast, a resize or a new module after `prepare` raises, naming the parameter.

    Before: at stage 3 `model.half()` was undone by the next gather (training went on in
    fp32), a resized embedding failed with an unrelated IndexError/shape error, and a replaced
    head trained without its gradients reaching any optimizer.
    """
    changes: dict[str, Callable[[nn.Module], Any]] = {
        "is \\(24, 8\\) float16 on cpu, was \\(24, 8\\) float32": lambda m: m.half(),
        "'head.weight' is \\(2, 24\\)": (
            lambda m: setattr(m.head.weight, "data", torch.zeros(2, 24))
        ),
        "'head.weight' is a new Parameter": lambda m: setattr(m, "head", nn.Linear(WIDTH, 1)),
    }
    with single_process_group("cpu", tmp_path):
        for message, change in changes.items():
            model, opt = prepare(Stack(), _adamw, ZeroConfig(stage=stage, min_shard_numel=0))
            model(_data()).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                change(model)
            if "new Parameter" in message:  # the forward runs; the step finds it
                model(_data()).backward()
                with pytest.raises(RuntimeError, match=message):
                    opt.step()
                continue
            with pytest.raises(RuntimeError, match=f"changed after `prepare` .*{message}"):
                model(_data())
    # unchanged: the hooks let training run (a forward under no_grad, two steps)
    (tmp_path / "again").mkdir()
    with single_process_group("cpu", tmp_path / "again"):
        model, opt = prepare(Stack(), _adamw, ZeroConfig(stage=stage, min_shard_numel=0))
        with torch.no_grad():
            model(_data())
        for _ in range(2):
            model(_data()).backward()
            opt.step()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_copying_or_pickling_a_prepared_model(tmp_path: Path, stage: int) -> None:
    """`copy.deepcopy` (an EMA model) and `torch.save(model)`.

    Stages 1-2: the copy holds the values of the moment it was made (a later step does not
    change them). Stage 3: both refuse with a message naming `full_state_dict`; before, the
    copy's forward failed with a bare `KeyError: <number>` and `torch.save` with "Can't pickle
    local object ... <lambda>".
    """
    import copy
    import io

    with single_process_group("cpu", tmp_path):
        model, opt = prepare(Stack(), _adamw, ZeroConfig(stage=stage, min_shard_numel=0))
        model(_data()).backward()
        opt.step()
        opt.zero_grad()
        if stage == 3:
            for what, act in (
                ("copy.deepcopy", lambda: copy.deepcopy(model)),
                (r"pickling \(torch.save\)", lambda: torch.save(model, io.BytesIO())),
            ):
                with pytest.raises(
                    TypeError, match=f"{what} of a model prepared .*full_state_dict"
                ):
                    act()
            model(_data()).backward()  # the refused copies changed nothing: training goes on
            opt.step()
            return
        snapshot = copy.deepcopy(model)
        with torch.no_grad():
            before = snapshot(_data()).item()
            assert before == model(_data()).item()
        model(_data()).backward()
        opt.step()
        with torch.no_grad():
            assert snapshot(_data()).item() == before
            assert model(_data()).item() != before
        torch.save(model, io.BytesIO())


def _freeze_and_unfreeze(rank: int, world: int) -> None:
    """Freezing after `prepare` trains as torch does; unfreezing and new groups raise."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
    mine = x[rank * 4 : rank * 4 + 4]  # this rank's half of the global batch

    def run(model: nn.Module, opt: Any, batch: torch.Tensor, read: Any) -> torch.Tensor:
        """Train 4 steps, freezing two parameters before the third; their value then."""
        for step in range(4):
            if step == 2:
                model.layers[1].weight.requires_grad_(False)
                model.inp.bias.requires_grad_(False)
                at_freeze = read(model)["layers.1.weight"].clone()
            model(batch).backward()
            opt.step()
            opt.zero_grad()
        return at_freeze

    def frozen_head_bias() -> Stack:
        model = Stack()
        model.head.bias.requires_grad_(False)
        return model

    plain = frozen_head_bias()
    run(plain, _adamw(list(plain.parameters())), x, lambda m: m.state_dict())
    for stage in (1, 2, 3):
        config = ZeroConfig(stage=stage, min_shard_numel=0)
        model, opt = prepare(frozen_head_bias(), _adamw, config)
        at_freeze = run(model, opt, mine, full_state_dict)
        got = full_state_dict(model)
        for name, want in plain.state_dict().items():
            torch.testing.assert_close(got[name], want, atol=1e-6, rtol=1e-5, msg=name)
        assert torch.equal(got["layers.1.weight"], at_freeze)  # not stepped after freezing
        with pytest.raises(ValueError, match="`add_param_group` after `prepare` is not"):
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
        model.layers[1].weight.requires_grad_(True)  # trainable at `prepare`: fine
        model(mine)
        model.head.bias.requires_grad_(True)  # frozen at `prepare`
        with pytest.raises(RuntimeError, match=r"'head\.bias' requires grad, it was frozen"):
            model(mine)


@pytest.mark.distributed
def test_freezing_after_prepare_trains_as_torch_and_unfreezing_raises(tmp_path: Path) -> None:
    """Freezing later equals plain torch (world 2 against one process on the global batch).

    Before: unfreezing a parameter frozen at `prepare` trained nothing, silently (it has no
    master and no optimizer entry), and `add_param_group` was accepted, its parameters stepped
    on each rank's own gradients.
    """
    spawn(_freeze_and_unfreeze, world_size=2, tmp_path=tmp_path)


_FACTORIES = {
    torch.empty,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.tensor,
    torch.as_tensor,
    torch.arange,
    torch.empty_strided,
    torch.rand,
    torch.randn,
}


class _DevicelessFactories(TorchFunctionMode):
    """Records shard_zero lines that create a tensor without saying on which device."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None:
            caller = sys._getframe(1)
            if caller.f_globals.get("__name__", "").startswith("shard_zero"):
                self.found.append(f"{caller.f_code.co_filename}:{caller.f_lineno} {func.__name__}")
        return func(*args, **kwargs)


def _plain(device: torch.device, steps: int) -> dict[str, torch.Tensor]:
    model = Stack().to(device)
    opt = _adamw(list(model.parameters()))
    for _ in range(steps):
        model(_data(device)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(model: nn.Module, opt: Any, device: torch.device, steps: int) -> None:
    for _ in range(steps):
        x = _data(device)
        with model.no_sync():  # type: ignore[operator]
            (model(x[:2]) / 2).backward()
        (model(x[2:]) / 2).backward()
        opt.clip_grad_norm_(1e9)  # a no-op clip that still runs the norm's collective
        opt.step()
        opt.zero_grad()


def _world_one_on(device: torch.device, tmp: Path) -> None:
    """prepare + steps + checkpoint at world 1 on `device` equal plain training there."""
    steps = 3
    init = {k: v.detach().clone() for k, v in Stack().to(device).state_dict().items()}
    # the micro-batch halves are averaged: same gradient as the whole batch up to rounding
    ref = _plain(device, steps)
    for stage in (1, 2, 3):
        tracker = _DevicelessFactories()
        with tracker:
            config = ZeroConfig(stage=stage, min_shard_numel=0, bucket_numel=300, timeout=60)
            model, opt = prepare(Stack().to(device), _adamw, config)
            engine = engine_of(model)
            assert engine.device == device
            assert all(u.full.device == device for u in engine.units)
            _train(model, opt, device, steps)
            assert all(e.master.device == device for e in engine.entries)
            for state in opt.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        assert value.device == device, (stage, key, value.device)
            got = full_state_dict(model)
            save_checkpoint(tmp / f"ckpt-{stage}", model, opt)
            fresh, fresh_opt = prepare(Stack().to(device), _adamw, config)
            load_checkpoint(tmp / f"ckpt-{stage}", fresh, fresh_opt)
            for state in fresh_opt.state.values():
                assert state["exp_avg"].device == device
            _train(model, opt, device, 1)
            _train(fresh, fresh_opt, device, 1)
            resumed, uninterrupted = full_state_dict(fresh), full_state_dict(model)
        assert not tracker.found, f"tensors created without a device: {sorted(set(tracker.found))}"
        assert (tmp / f"ckpt-{stage}" / "rank00000.safetensors").is_file()  # CPU tensors
        for key, final in ref.items():
            assert got[key].device.type == "cpu"  # full_state_dict gathers to the CPU
            d_ref = (final - init[key]).double()
            d_got = got[key].to(device).double() - init[key].double()
            err = float((d_got - d_ref).norm() / d_ref.norm())
            assert err < 1e-5, f"stage {stage} on {device}: {key}: update error {err:.3g}"
            assert torch.equal(resumed[key], uninterrupted[key]), f"stage {stage}: {key} resume"
    # mixed precision runs on the device too (values are checked by the bf16 parity test)
    config = ZeroConfig(stage=3, min_shard_numel=0, param_dtype=torch.bfloat16)
    model, opt = prepare(Stack().to(device), _adamw, config)
    for _ in range(2):
        model(_data(device).to(torch.bfloat16)).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.isfinite(v).all() for v in full_state_dict(model).values())


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_world_one_on_device_matches_plain_training(tmp_path: Path, device: str) -> None:
    """On CUDA: NCCL (gloo with CUDA tensors where NCCL is missing); on CPU: gloo, plus the
    check that no shard_zero line creates a tensor without a device (a CPU-only buffer)."""
    with single_process_group(device, tmp_path) as where:
        _world_one_on(where, tmp_path)


# ---------------------------------------------------------------------- divergent ranks


def _skipped_unit(rank: int, world: int) -> None:
    x = _data()
    for prefetch in (True, False):
        config = ZeroConfig(stage=3, min_shard_numel=0, prefetch=prefetch, timeout=TIMEOUT)
        model, opt = prepare(Stack(), _adamw, config)
        model(x).backward()  # one agreeing step first
        opt.step()
        opt.zero_grad()
        skip = (1,) if rank == 1 else ()
        # rank 1 never runs layers.1 (same size as its neighbours, so without the check the
        # gathers would pair up silently); both ranks see the mismatch at the same gather
        with pytest.raises(RuntimeError, match=r"ranks ran different modules: rank [01] gathered"):
            model(x, skip=skip).backward()
    # `timeout` needs a group over every rank (else new_group would need the others too)
    sub = dist.new_group([0])  # every rank calls new_group
    if rank == 0:
        with pytest.raises(ValueError, match="default process group only"):
            prepare(Stack(), _adamw, ZeroConfig(timeout=TIMEOUT), group=sub)
    # the parameter-set check still works with a timeout group
    with pytest.raises(ValueError, match="ranks disagree"):
        prepare(Stack(depth=2 + rank), _adamw, ZeroConfig(timeout=TIMEOUT))


@pytest.mark.distributed
def test_a_rank_that_skips_a_unit_raises_a_clear_error(tmp_path: Path) -> None:
    spawn(_skipped_unit, world_size=2, tmp_path=tmp_path)


def _extra_backward(rank: int, world: int, stage: int) -> None:
    config = ZeroConfig(stage=stage, min_shard_numel=0, timeout=TIMEOUT)  # type: ignore[arg-type]
    model, opt = prepare(Stack(), _adamw, config)
    x = _data()
    for _ in range(2 if rank == 0 else 1):  # rank 0 runs one forward/backward more
        model(x).backward()
    opt.step()


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_an_extra_backward_on_one_rank_fails_after_the_timeout(tmp_path: Path, stage: int) -> None:
    # stage 2: rank 0's extra reduce-scatter meets rank 1's per-step check; stage 3: rank 0's
    # next gather does. gloo pairs neither (no data exchanged): both time out after 3 s, and the
    # first rank to fail reports the cause (gloo words its timeout "3000ms" or "Application
    # timeout caused pair closure" depending on which collective times out first)
    with pytest.raises(Exception, match=r"(?s)(3000ms|timeout).*ranks ran different code") as info:
        spawn(_extra_backward, stage, world_size=2, tmp_path=tmp_path)
    assert "ZeroConfig.timeout` 0:00:03" in str(info.value)
