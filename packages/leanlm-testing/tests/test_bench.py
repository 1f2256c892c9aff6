import subprocess
import time

import pytest
import torch

from leanlm_testing import bench


def test_interleaved_medians_time_each_case_in_turn():
    calls: list[str] = []

    def case(name: str, seconds: float):
        def run() -> None:
            calls.append(name)
            time.sleep(seconds)

        return run

    medians = bench.interleaved_medians(
        {"fast": case("fast", 0.001), "slow": case("slow", 0.02)}, rounds=3, warmup=1
    )
    assert calls == ["fast", "slow"] + ["fast", "slow"] * 3  # warm-up, then alternating
    assert medians["slow"] >= 0.02
    assert medians["fast"] < medians["slow"]


def test_median_is_the_median_not_the_mean():
    durations = iter([0.0, 0.001, 0.001, 0.05])  # warm-up, then one outlier among three

    medians = bench.median_seconds(lambda: time.sleep(next(durations)), repeats=3)
    assert 0.001 <= medians < 0.01


def test_sync_runs_after_every_timed_call():
    waits: list[int] = []
    bench.interleaved_medians(
        {"a": lambda: None, "b": lambda: None},
        rounds=2,
        warmup=0,
        sync=lambda: waits.append(1),
    )
    assert len(waits) == 1 + 2 * 2  # once after the warm-ups, once per timed call


@pytest.mark.parametrize("rounds", [0, -1])
def test_rounds_must_be_positive(rounds):
    with pytest.raises(ValueError, match=f"`rounds` must be >= 1, got {rounds}"):
        bench.interleaved_medians({"a": lambda: None}, rounds=rounds)
    with pytest.raises(ValueError, match=f"`repeats` must be >= 1, got {rounds}"):
        bench.median_seconds(lambda: None, repeats=rounds)


def test_peak_rss_sees_an_allocation_and_resets():
    bench.reset_peak_rss()
    before = bench.peak_rss_mib()
    x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    grown = bench.peak_rss_mib() - before
    del x
    assert grown >= 60
    now = bench.reset_peak_rss()
    assert bench.peak_rss_mib() < now + 30


def test_rss_field_must_exist():
    with pytest.raises(RuntimeError, match="'VmNope' is not a field"):
        bench.rss_kib("VmNope")


def test_git_revision_names_the_commit_and_marks_changes(tmp_path):
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True
        ).stdout.strip()

    assert bench.git_revision(tmp_path) == "unknown"
    git("init", "-q")
    (tmp_path / "f.txt").write_text("a")
    git("add", "f.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "m")
    sha = git("rev-parse", "--short", "HEAD")
    assert bench.git_revision(tmp_path) == sha
    (tmp_path / "f.txt").write_text("b")
    assert bench.git_revision(tmp_path / "f.txt") == f"{sha} (+ uncommitted changes)"


def test_header_names_versions_and_device():
    line = bench.header("bench_x", "cpu", ["torch", "no-such-dist-xyz"])
    assert line.startswith("# bench_x  device CPU: ")
    assert f"torch {torch.__version__}" in line
    assert "no-such-dist-xyz not installed" in line
    assert "git " in line


def test_environment_states_cpu_threads_only_for_cpu(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        env = bench.environment("cpu", ["torch"])
        assert env["torch threads"] == "1"
        torch.set_num_threads(2)
        assert bench.environment("cpu")["torch threads"] == "2"
    finally:
        torch.set_num_threads(before)
    assert list(env)[:2] == ["device", "torch threads"]
    assert env["torch"] == torch.__version__
    assert bench.header("b", "cpu").count("torch threads ") == 1
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: "Fake GPU")
    gpu = bench.environment("cuda:0")
    assert gpu["device"] == "CUDA: Fake GPU"
    assert "torch threads" not in gpu


def test_state_bytes_counts_every_state_tensor_and_a_shared_one_once():
    params = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5))]
    opt = torch.optim.SGD(params, lr=0.1)
    shared = torch.zeros(256)  # as bitsandbytes' quantization map, held by every state
    opt.state[params[0]] = {"m": torch.zeros(3, 4, dtype=torch.uint8), "map": shared, "step": 1}
    opt.state[params[1]] = {"m": torch.zeros(5, dtype=torch.bfloat16), "map": shared}
    assert bench.state_bytes(opt) == 12 + 10 + 256 * 4
    opt.state[params[1]]["m"] = torch.empty(5, 7, device="meta")  # counted from the shape
    assert bench.state_bytes(opt) == 12 + 140 + 256 * 4


def test_kernel_times_counts_what_one_call_runs():
    a = torch.randn(256, 256)
    b = torch.zeros(8)

    def step():
        torch.mm(a, a)
        torch.mm(a, a)
        b.add_(1)

    rows = bench.kernel_times(step, "cpu", calls=3, warmup=2)
    by_name = {name: (launches, us) for name, launches, us in rows}
    assert by_name["aten::mm"][0] == 2  # per call, not per profiled window
    assert by_name["aten::add_"][0] == 1
    assert [us for *_, us in rows] == sorted((us for *_, us in rows), reverse=True)
    assert rows[0][0] == "aten::mm"  # two 256^3 products outlast an 8-element add
    assert b[0] == 5  # warmup + profiled calls, each once


def test_kernel_times_needs_a_call():
    with pytest.raises(ValueError, match="`calls` must be >= 1, got 0"):
        bench.kernel_times(lambda: None, "cpu", calls=0)


@pytest.mark.gpu
def test_kernel_times_lists_gpu_kernels_gpu():
    a = torch.randn(1024, 1024, device="cuda")
    b = torch.zeros(1, device="cuda")

    def step():
        a @ a
        b.add_(1)

    rows = bench.kernel_times(step, "cuda", calls=4)
    assert rows, "no kernel seen"
    assert not any(name.startswith("aten::") for name, *_ in rows)  # kernels, not operators
    assert sum(launches for _, launches, _ in rows) >= 2  # the GEMM and the add, per call
    assert rows[0][2] > 0  # device µs
    torch.cuda.synchronize()
    assert b.item() == 5  # warmup + 4 profiled calls
