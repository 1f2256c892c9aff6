"""ZeRO-Offload (`offload_optimizer`): the optimizer steps host copies, with the same result.

One world-2 run (gloo, CPU) trains, for every stage, AdamW, CAME and Adafactor (factored
statistics, beta1 momentum, HF's relative step) engines with and without
`offload_optimizer` side by side on the same micro-batches (one under `no_sync()`, then two
backwards outside it, so the second adds into a gradient already on the host) with clipping.
On a CPU model "host" and "device" are both CPU memory, so the test checks identity and values:

* before every step the host gradients equal the on-device engine's bit for bit and no gradient
  is left on the device; after it the host masters changed and equal the on-device masters bit
  for bit, and so do the optimizer state tensors, which are keyed by the host masters and share
  no memory with the model (a step on the device copies, or host state never written, fails);
* `memory_stats` reports the masters and the state as host bytes only;
* the trained weights are bit-identical to the on-device engine's (also with bf16 compute, and
  with a bf16 accumulator offloaded between micro-batches) and, in fp32, match single-process
  training (world 1 without offload) to the parity tests' update-error bound;
* a checkpoint written with offload loads without it and back, and training on equals the
  uninterrupted run bit for bit (CAME and Adafactor);
* the CUDA side stream of the gradient copies, through recorded CPU stand-ins of the stream
  calls (the order of waits, copies and `record_stream`; the real one runs in the `gpu` case).
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from leanlm_testing import spawn
from leanlm_testing.asserts import update_error
from leanlm_testing.distributed import CPU_AND_CUDA, single_process_group
from leanlm_testing.models import random_batches, tiny_llama
from optim_adafactor import Adafactor
from optim_came import CAME
from shard_zero import (
    ZeroConfig,
    _comm,
    full_state_dict,
    load_checkpoint,
    memory_stats,
    prepare,
    save_checkpoint,
)
from shard_zero._api import engine_of

TOL = 1e-4  # the parity tests' update-error bound against single-process training
BF16 = torch.bfloat16
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    "came": lambda ps: CAME(ps, lr=1e-2, weight_decay=0.01, instability_init=1.0),
    # factored 2-D statistics, momentum and HF's relative step with parameter scale: the host
    # step all-reduces each row shard's column sums, row-statistic mean, update and parameter
    # RMS over the host group
    "adafactor": lambda ps: Adafactor(ps, beta1=0.9, weight_decay=0.1),
}
# (stage, optimizer, extra config): fp32 cases are also compared with single-process training
CASES: list[tuple[int, str, dict[str, Any]]] = [
    *[(s, opt, {}) for s in (1, 2, 3) for opt in OPTIMIZERS],
    (2, "adamw", {"param_dtype": BF16}),
    (3, "came", {"param_dtype": BF16, "accum_dtype": BF16, "offload_accum": True}),
    (1, "adafactor", {"param_dtype": BF16}),
]


def _make(name: str) -> Any:
    return OPTIMIZERS[name]


def _batches() -> list[torch.Tensor]:
    return [b["input_ids"] for b in random_batches(256, batches=2, batch_size=12, seq_len=16)]


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _reference(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    model = tiny_llama(seed=0)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = _make(name)(list(model.parameters()))
    for ids in _batches():
        _loss(model, ids).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return init, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _backward(runs: list[Any], ids: torch.Tensor, rank: int, world: int) -> None:
    """This rank's part of `ids` in 3 micro-batches: the first under `no_sync()`."""
    per = ids.shape[0] // world
    for i, micro in enumerate(ids[rank * per : (rank + 1) * per].chunk(3)):
        for model, _ in runs:
            with model.no_sync() if i == 0 else contextlib.nullcontext():
                (_loss(model, micro) / 3).backward()


def _storages(model: nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def _check_state(device: Any, offload: Any, stage: int) -> None:
    """The offloaded optimizer's state is keyed by the host masters, equal to the on-device
    one, and shares no memory with the model; memory_stats counts it on the host."""
    (d_model, d_opt), (o_model, o_opt) = device, offload
    d_eng, o_eng = engine_of(d_model), engine_of(o_model)
    model_memory = _storages(o_model)
    for d, o in zip(d_eng.entries, o_eng.entries, strict=True):
        assert torch.equal(o.master, d.master), (stage, o.name)
        assert o.master.untyped_storage().data_ptr() not in model_memory, (stage, o.name)
        d_state, o_state = d_opt.state[d.master], o_opt.state[o.master]
        assert o_state, (stage, o.name)
        assert d_state.keys() == o_state.keys(), (stage, o.name)
        for key, value in o_state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, d_state[key]), (stage, o.name, key)
                assert value.untyped_storage().data_ptr() not in model_memory
    stats, d_stats = memory_stats(*offload), memory_stats(*device)
    assert stats["master_params"] == stats["optimizer_state"] == stats["grads"] == 0, stats
    assert stats["total"] == stats["params"] == d_stats["params"]
    local = sum(e.master.numel() for e in o_eng.entries)
    accum = sum(e.host_acc.nbytes for e in o_eng.entries if e.host_acc is not None)
    assert stats["host_master_params"] == stats["host_grads"] - accum == 4 * local, stats
    assert stats["host_optimizer_state"] == d_stats["optimizer_state"] > 0, (stats, d_stats)


def _run(rank: int, world: int, tmp: str) -> None:
    refs = {name: _reference(name) for name in OPTIMIZERS}
    for stage, name, extra in CASES:
        runs = [
            prepare(
                tiny_llama(seed=0),
                _make(name),
                ZeroConfig(
                    stage=stage,  # type: ignore[arg-type]
                    min_shard_numel=100,
                    bucket_numel=5000,  # several buckets, some parameters in pieces
                    offload_optimizer=offload,
                    **extra,
                ),
            )
            for offload in (False, True)
        ]
        device_engine, engine = (engine_of(m) for m, _ in runs)
        assert engine.offload
        assert not device_engine.offload
        for ids in _batches():
            _backward(runs, ids, rank, world)
            for d, o in zip(device_engine.entries, engine.entries, strict=True):
                assert o.dev_grad is None, "a gradient left on the device"
                assert o.low_acc is None
                assert o.param.grad is None
                assert o.master.grad is o.host_grad
                assert o.master.grad is not None
                assert d.master.grad is not None
                assert torch.equal(o.master.grad, d.master.grad), (stage, name, o.name)
            before = [e.master.detach().clone() for e in engine.entries]
            for _, opt in runs:
                opt.clip_grad_norm_(0.5)
                opt.step()
                opt.zero_grad()
            changed = [
                not torch.equal(b, e.master) for b, e in zip(before, engine.entries, strict=True)
            ]
            assert all(changed), (stage, name, "host masters not updated")
            _check_state(runs[0], runs[1], stage)
        got, on_device = (full_state_dict(m) for m, _ in runs)
        for key, value in on_device.items():
            assert torch.equal(got[key], value), (stage, name, extra, key)
        if not extra:  # world 2 with offload against world 1 without
            err = update_error(*refs[name], got)
            assert err < TOL, (stage, name, err)
    for name in ("came", "adafactor"):
        _checkpoint_round_trip(rank, world, Path(tmp) / name, name)


def _checkpoint_round_trip(rank: int, world: int, tmp: Path, name: str) -> None:
    """offload (stage 3) -> save -> on-device (stage 2) -> save -> offload (stage 3): the same.

    (Stage 1 sums micro-batches before reducing them, so it is not bit-equal to stages 2-3.)"""

    def make(stage: int, offload: bool) -> Any:
        config = ZeroConfig(
            stage=stage,  # type: ignore[arg-type]
            min_shard_numel=100,
            offload_optimizer=offload,
        )
        return prepare(tiny_llama(seed=0), _make(name), config)

    def train(run: Any, ids: torch.Tensor) -> None:
        _backward([run], ids, rank, world)
        run[1].step()
        run[1].zero_grad()

    batches = _batches()
    first = make(3, True)
    train(first, batches[0])
    save_checkpoint(tmp / "offloaded", *first)
    plain = make(2, False)
    load_checkpoint(tmp / "offloaded", *plain)
    save_checkpoint(tmp / "plain", *plain)
    back = make(3, True)
    load_checkpoint(tmp / "plain", *back)
    assert {id(p) for p in back[1].state} == {id(e.master) for e in engine_of(back[0]).entries}
    for run in (first, plain, back):
        train(run, batches[1])
    weights = [full_state_dict(m) for m, _ in (first, plain, back)]
    for key, value in weights[0].items():
        assert torch.equal(weights[1][key], value), (name, "offload -> on-device", key)
        assert torch.equal(weights[2][key], value), (name, "on-device -> offload", key)


@pytest.mark.distributed
def test_offload_equals_on_device_and_single_process(tmp_path: Path) -> None:
    spawn(_run, str(tmp_path), world_size=2, tmp_path=tmp_path)


def test_offload_optimizer_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match="`offload_optimizer`"):
        ZeroConfig(offload_optimizer="yes")  # type: ignore[arg-type]
    # on CUDA with a non-gloo subgroup the host optimizer has no group for its statistics
    subgroup = object()
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2 if group is subgroup else 4)
    with pytest.raises(ValueError, match=r"`offload_optimizer` \(True\) on CUDA .* 2 of 4 ranks"):
        _comm.host_group(subgroup, torch.device("cuda", 0), None)
    cpu_group = object()
    assert _comm.host_group(cpu_group, torch.device("cpu"), None) is cpu_group


def _world_one(device: torch.device) -> None:
    """World 1 on `device`: offload against the on-device engine, AdamW and Adafactor, fp32
    (CUDA: stages 1-3; CPU, where the world-2 test covers every stage: stage 3).

    The masters and the optimizer state are host tensors (pinned on CUDA) and the device holds
    neither; the weights are bit-equal on CPU, and on CUDA within 1e-5 update error (torch's CPU
    and CUDA AdamW, Adafactor's PyTorch path on the host and its fused kernels on the device,
    and the gradient norms round differently).
    """
    stages = (1, 2, 3) if device.type == "cuda" else (3,)  # the CPU: the spawned test
    for stage, name in itertools.product(stages, ("adamw", "adafactor")):
        runs = [
            prepare(
                tiny_llama(seed=0).to(device),
                _make(name),
                ZeroConfig(
                    stage=stage,
                    min_shard_numel=100,
                    bucket_numel=5000,
                    offload_optimizer=offload,
                ),
            )
            for offload in (False, True)
        ]
        for ids in _batches():
            _backward(runs, ids.to(device), 0, 1)
            for _, opt in runs:
                opt.clip_grad_norm_(0.5)
                opt.step()
                opt.zero_grad()
        engine = engine_of(runs[1][0])
        for e in engine.entries:
            assert e.master.device.type == "cpu"
            assert e.param.device == device
            assert e.master.is_pinned() == (device.type == "cuda"), e.name
            state = runs[1][1].state[e.master]
            assert all(v.device.type == "cpu" for v in state.values() if torch.is_tensor(v))
        stats = memory_stats(*runs[1])
        assert stats["master_params"] == stats["optimizer_state"] == 0, stats
        init = {k: v.cpu() for k, v in tiny_llama(seed=0).state_dict().items()}
        on_device, got = (full_state_dict(m) for m, _ in runs)
        if device.type == "cpu":
            assert all(torch.equal(got[k], v) for k, v in on_device.items()), (stage, name)
        else:
            err = update_error(init, on_device, got)
            assert err < 1e-5, (stage, name, err)


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_world_one_offload_on_device(tmp_path: Path, device: str) -> None:
    """On CUDA: NCCL (the host optimizer's statistics then go over a new gloo group)."""
    with single_process_group(device, tmp_path) as where:
        _world_one(where)


class _Streams:
    """CUDA's stream calls on the CPU, recorded: the engine's side stream and the current one."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.inside = False  # inside `torch.cuda.stream(side)`
        self.side, self.current = _Stream(self, "side"), _Stream(self, "current")

    @contextlib.contextmanager
    def stream(self, s: _Stream) -> Any:
        assert s is self.side
        self.inside = True
        yield
        self.inside = False


class _Stream:
    def __init__(self, streams: _Streams, name: str) -> None:
        self.streams, self.name = streams, name

    def wait_stream(self, other: _Stream) -> None:
        self.streams.log.append(f"{self.name} waits for {other.name}")

    def synchronize(self) -> None:
        self.streams.log.append(f"sync {self.name}")


def test_gradient_copies_run_on_the_side_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA each gradient goes to the host on a side stream; CPU stand-ins record the calls.

    Each copy waits for the current stream (the reduction), runs inside the side stream and
    keeps its source alive for it (`record_stream`); a backward that adds to a host gradient
    first makes the current stream wait for the side stream; step and zero_grad synchronize
    both. Training equals the engine without the stand-ins bit for bit.
    """
    fake = _Streams()
    copy = torch.Tensor.copy_

    def logged_copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> Any:
        if fake.inside:
            fake.log.append("copy")
        return copy(dst, src, non_blocking)

    with single_process_group("cpu", tmp_path):
        results = []
        for fakes in (False, True):
            config = ZeroConfig(
                stage=2, min_shard_numel=100, bucket_numel=5000, offload_optimizer=True
            )
            model, opt = prepare(tiny_llama(seed=0), _make("adamw"), config)
            engine = engine_of(model)
            if fakes:
                monkeypatch.setattr(torch.cuda, "current_stream", lambda device: fake.current)
                monkeypatch.setattr(torch.cuda, "stream", fake.stream)
                monkeypatch.setattr(torch.Tensor, "copy_", logged_copy)
                monkeypatch.setattr(
                    torch.Tensor, "record_stream", lambda t, s: fake.log.append(f"record {s.name}")
                )
                engine.copy_stream = fake.side
            ids = _batches()[0]
            _loss(model, ids[:6]).backward()
            one_copy = ["side waits for current", "copy", "record side"]
            copies = len(engine.entries)
            assert not fakes or fake.log == one_copy * copies, fake.log[:8]
            fake.log.clear()
            _loss(model, ids[6:]).backward()  # adds into the gradients on the host
            assert not fakes or fake.log.count("current waits for side") == copies, fake.log[:8]
            assert not fakes or fake.log.count("copy") == copies
            fake.log.clear()
            opt.step()
            assert not fakes or fake.log[:2] == ["sync current", "sync side"], fake.log[:4]
            opt.zero_grad()
            monkeypatch.undo()
            results.append(full_state_dict(model))
        assert all(torch.equal(results[1][k], v) for k, v in results[0].items())
