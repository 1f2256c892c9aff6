"""The scale simulator on a shrunk Llama at world 4: memory targets, communication, mutants.

Everything runs on fake tensors under torch's fake process group (no data, no memory, one
process), so the model may be full width; it is shrunk to 3 decoder layers to keep the step
short. The targets are those of `benchmarks/RESULTS.md`, checked on the per-rank peak that
MemTracker measures in the same run for shard-zero and FSDP2. Two mutants of the engine, made by
monkeypatching, must fail the checks that the real engine passes: one that launches no gradient
reduction before backward ends and never frees a stage-3 unit early, and one that starts every
stage-1/2 parameter all-gather before waiting for any.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from shard_zero import _engine
from shard_zero._reduce import Reducer
from shard_zero._units import Unit, Units
from shard_zero.simulate import (
    PRESET_PARAMS,
    PRESETS,
    SimConfig,
    SimReport,
    SystemResult,
    model_config,
    simulate,
)
from shard_zero.simulate.__main__ import main

SHRUNK = {  # Llama-3-8B's layer shape, a 32k vocabulary and 3 decoder layers
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 3,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
WORLD = 4


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("sim") / "config.json"
    path.write_text(json.dumps(SHRUNK))
    return str(path)


def _sim(config_path: str, **kwargs: Any) -> SimReport:
    return simulate(SimConfig(model=config_path, world_size=WORLD, seq_len=512, **kwargs))


@pytest.fixture(scope="module")
def adamw(config_path: str) -> SimReport:
    return _sim(config_path, stages=(1, 2, 3), replica=True)


def _peak(result: SystemResult) -> int:
    assert result.error is None, result.error
    return result.peak["total"]


def _units_bound(result: SystemResult) -> int:
    """The root unit plus two decoder-layer units (bf16): what stage 3 may hold gathered."""
    root, *layers = result.extra["unit_bytes"]
    return int(root + 2 * max(layers))


def _gather_spread(result: SystemResult) -> int:
    """How much the live bytes grow over the optimizer step's parameter all-gathers."""
    live = [e[5] for e in result.events if e[4] == "step" and e[1] == "all_gather"]
    assert len(live) > 4, "expected several parameter all-gathers in the step"
    return max(live) - min(live)


def test_memory_targets_against_fsdp2(adamw: SimReport) -> None:
    zero1, zero2, zero3 = (adamw.get(f"shard-zero-{s}") for s in (1, 2, 3))
    fsdp_reshard, fsdp_keep = adamw.get("fsdp2-reshard"), adamw.get("fsdp2-no-reshard")
    assert _peak(zero3) <= 1.05 * _peak(fsdp_reshard)
    assert _peak(zero2) <= 1.05 * _peak(fsdp_keep)
    # stage 1 holds no more gradient bytes than a replica (what DDP holds), at any time
    replica = adamw.get("replica")
    assert zero1.maxima["grads"] <= replica.maxima["grads"]
    # the replica's gradients all count, the last one made in backward (the embedding's) too
    assert replica.maxima["grads"] == pytest.approx(2 * adamw.psi, rel=1e-3)
    # model states add up as they should: masters 4Ψ/N, AdamW 8Ψ/N, bf16 parameters 2Ψ
    psi = adamw.psi
    for result in (zero1, zero2, zero3):
        assert result.maxima["masters"] == pytest.approx(4 * psi / WORLD, rel=0.02)
        assert result.maxima["optimizer state"] == pytest.approx(8 * psi / WORLD, rel=0.02)
    assert zero2.maxima["params"] == pytest.approx(2 * psi, rel=0.01)
    assert zero3.maxima["params"] <= _units_bound(zero3)  # units are freed right after use


def test_communication_per_step(adamw: SimReport) -> None:
    psi = adamw.psi
    for stage in (1, 2, 3):
        result = adamw.get(f"shard-zero-{stage}")
        # gradients reduce-scattered once in fp32 (4 bytes), parameters gathered in bf16
        assert result.bytes["reduce_scatter"] == pytest.approx(4 * psi, rel=0.01)
        gathered = result.bytes["all_gather"] / (2 * psi)
        root = result.extra["unit_bytes"][0] / (2 * psi) if stage == 3 else 0.0
        expected = 1.0 if stage < 3 else 2.0 - root  # stage 3: twice, the root unit once
        assert gathered == pytest.approx(expected, rel=0.01)
    assert adamw.get("fsdp2-reshard").bytes["all_gather"] == pytest.approx(4 * psi, rel=0.01)


def test_reductions_overlap_backward_and_gathers_are_bounded(adamw: SimReport) -> None:
    assert adamw.get("shard-zero-1").overlap == 0.0  # stage 1 reduces at the boundary
    for stage in (2, 3):
        assert adamw.get(f"shard-zero-{stage}").overlap > 0.5
    for stage in (1, 2):
        result = adamw.get(f"shard-zero-{stage}")
        # at most two buckets in flight (bf16 output + its payload), far below a full copy
        bound = 2 * result.extra["bucket_numel"] * 2 * 1.5
        assert _gather_spread(result) <= bound < 2 * adamw.psi / 4


def test_came_is_below_adamw_and_fsdp2(config_path: str, adamw: SimReport) -> None:
    came_run = _sim(config_path, stages=(3,), optimizer="optim_came:CAME", fsdp2=False)
    came = came_run.get("shard-zero-3")
    assert _peak(came) < _peak(adamw.get("shard-zero-3"))
    assert _peak(came) < _peak(adamw.get("fsdp2-reshard"))
    assert came.calls["all_reduce"] > 1  # its factored statistics are all-reduced


@pytest.fixture(scope="module")
def four(config_path: str) -> SystemResult:
    """shard-zero-3 with 4 micro-batches per step (3 under `no_sync()`), fp32 accumulator."""
    return _sim(config_path, stages=(3,), micro_batches=4, fsdp2=False).get("shard-zero-3")


def test_accumulation_costs_only_the_sharded_fp32_gradient(
    four: SystemResult, adamw: SimReport
) -> None:
    one = adamw.get("shard-zero-3")
    accumulator = 4 * adamw.psi / WORLD  # fp32 gradient shards, alive between micro-batches
    assert _peak(four) <= _peak(one) + accumulator
    assert four.maxima["params"] <= _units_bound(four)  # units are still freed after use
    assert four.calls["reduce_scatter"] == 4 * one.calls["reduce_scatter"]


def test_a_bf16_accumulator_halves_what_accumulation_adds(
    config_path: str, four: SystemResult, adamw: SimReport
) -> None:
    one = adamw.get("shard-zero-3")
    low = _sim(config_path, stages=(3,), micro_batches=4, fsdp2=False, accum_dtype="bf16").get(
        "shard-zero-3"
    )
    # between micro-batches the sharded accumulator is bf16: 2 bytes per local element
    assert _peak(low) <= _peak(one) + 2 * adamw.psi / WORLD
    assert _peak(four) - _peak(low) >= 0.9 * 2 * adamw.psi / WORLD
    # the optimizer still reads fp32 gradients: the step holds the same fp32 shards
    assert low.maxima["grads"] >= 4 * adamw.psi / WORLD * 0.99


def test_an_offloaded_accumulator_adds_no_device_memory(
    config_path: str, four: SystemResult, adamw: SimReport
) -> None:
    one = adamw.get("shard-zero-3")
    off = _sim(config_path, stages=(3,), micro_batches=4, fsdp2=False, offload_accum=True).get(
        "shard-zero-3"
    )
    # the target: accumulating 4 micro-batches costs <= 5% over 1 (on the device)
    assert _peak(four) > 1.05 * _peak(one)  # the on-device fp32 accumulator misses it here
    assert _peak(off) <= 1.05 * _peak(one)
    # the accumulator is all in host memory (fp32, this rank's rows), outside the device peak
    host = off.peak["host"]
    assert host == pytest.approx(4 * adamw.psi / WORLD, rel=0.02)
    assert one.peak["host"] == 0
    # what it costs, measured: micro-batch 1 writes the buffers, 2 and 3 read and write them,
    # the boundary reads them (every row once per pass)
    assert off.bytes["to_host"] == 3 * host
    assert off.bytes["from_host"] == 3 * host
    assert "to_host" not in four.bytes
    assert off.maxima["params"] <= _units_bound(off)
    assert off.calls["reduce_scatter"] == 4 * one.calls["reduce_scatter"]


def test_an_offloaded_optimizer_keeps_masters_and_state_on_the_host(
    config_path: str, adamw: SimReport
) -> None:
    off = _sim(config_path, stages=(2, 3), fsdp2=False, offload_optimizer=True)
    local = adamw.psi / WORLD
    for stage in (2, 3):
        on, o = adamw.get(f"shard-zero-{stage}"), off.get(f"shard-zero-{stage}")
        # the device never holds an fp32 master or optimizer state ...
        assert o.maxima["masters"] == o.maxima["optimizer state"] == 0, o.maxima
        assert _peak(o) <= _peak(on) - 0.95 * 12 * local  # 4 + 8 bytes per local element
        assert o.formula is None  # the paper's formula counts them on the device
        # ... the host does: fp32 masters, gradients and AdamW moments, and the bf16 rows
        assert o.peak["host"] == pytest.approx((4 + 4 + 8 + 2) * local, rel=0.01)
        assert on.peak["host"] == 0
        # each gradient crosses once in fp32, the updated rows come back in bf16 (stage 3:
        # read by every gather of a unit, twice per step, the root unit's once)
        assert o.bytes["to_host"] == pytest.approx(4 * local, rel=0.01)
        if stage == 2:
            assert o.bytes["from_host"] == pytest.approx(2 * local, rel=0.01)
        else:
            assert 2 * local < o.bytes["from_host"] < 4 * local
    # stage 2: gradients leave the device bucket by bucket as backward runs, so the sharded
    # accumulator is never whole there (copying them at the end of backward would hold 4Ψ/N)
    assert off.get("shard-zero-2").maxima["grads"] < 0.5 * 4 * local


def test_bigger_buckets_mean_fewer_reduce_scatters_of_the_same_bytes(
    config_path: str, adamw: SimReport
) -> None:
    small = adamw.get("shard-zero-3")  # the default: 2**24 elements per bucket
    big = _sim(config_path, stages=(3,), fsdp2=False, bucket_numel=2**27).get("shard-zero-3")
    assert big.calls["reduce_scatter"] * 4 <= small.calls["reduce_scatter"]
    assert big.bytes["reduce_scatter"] == pytest.approx(small.bytes["reduce_scatter"], rel=0.01)
    # the price: larger reduce-scatter buffers in flight
    assert big.maxima["temporaries"] > small.maxima["temporaries"]


def test_the_lazy_mutant_fails_the_checks(
    config_path: str, adamw: SimReport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No reduce before the end of backward, no unit freed before it: both checks fail."""
    free = Unit.free

    def free_all(self: Units) -> None:
        for unit in self.units:
            free(unit)
            unit.grads_left = len(unit.entries)

    monkeypatch.setattr(Reducer, "_launch_ready", lambda self: None)
    monkeypatch.setattr(Unit, "free", lambda self: None)
    monkeypatch.setattr(Units, "free_all", free_all)
    lazy = _sim(config_path, stages=(3,), fsdp2=False).get("shard-zero-3")
    assert lazy.overlap == 0.0
    assert lazy.maxima["params"] > _units_bound(lazy)
    assert _peak(lazy) > 1.05 * _peak(adamw.get("fsdp2-reshard"))


def test_the_all_gathers_at_once_mutant_fails_the_check(
    config_path: str, adamw: SimReport, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_engine, "GATHERS_IN_FLIGHT", 10**9)
    eager = _sim(config_path, stages=(2,), fsdp2=False).get("shard-zero-2")
    assert _gather_spread(eager) >= 2 * adamw.psi * 0.9  # a second full bf16 copy


def test_presets_have_the_published_parameter_counts() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    assert set(PRESETS) == {"tinyllama-1.1b", "llama-3-8b", "llama-3-70b", "qwen2-7b", "mistral-7b"}
    for name, expected in PRESET_PARAMS.items():
        with FakeTensorMode():
            model = AutoModelForCausalLM.from_config(model_config(name))
        assert sum(p.numel() for p in model.parameters()) == expected, name


def test_bad_input_names_the_argument(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`model`"):
        model_config("llama-9")
    with pytest.raises(ValueError, match="`world_size`"):
        SimConfig(world_size=0)
    with pytest.raises(ValueError, match="`bucket_numel`"):
        SimConfig(bucket_numel=0)
    with pytest.raises(ValueError, match="`stages`"):
        SimConfig(stages=(4,))
    with pytest.raises(ValueError, match="`optimizer`"):
        simulate(SimConfig(model="llama-3-8b", optimizer="lion"))
    with pytest.raises(ValueError, match=r"`optimizer`.*cannot import"):
        simulate(SimConfig(model="llama-3-8b", optimizer="optim_came:Lion"))
    assert main(["--optimizer-kwargs", "[1]"]) == 2
    assert main(["--model", str(tmp_path / "missing.json")]) == 2


def test_cli_writes_table_plot_and_json(
    config_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    png, out = tmp_path / "t.png", tmp_path / "t.json"
    args = ["--model", config_path, "--layers", "1", "--world-size", "2", "--stages", "3"]
    assert main([*args, "--seq-len", "64", "--plot", str(png), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| shard-zero-3 |" in printed
    assert "| fsdp2-reshard |" in printed
    assert png.read_bytes()[:4] == b"\x89PNG"
    summary = json.loads(out.read_text())
    assert {s["name"] for s in summary["systems"]} == {
        "shard-zero-3",
        "fsdp2-reshard",
        "fsdp2-no-reshard",
    }
