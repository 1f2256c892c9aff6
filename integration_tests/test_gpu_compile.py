"""tools/gpu_compile.py: the gate flags what it should, on records and on real sm_80/90 compiles."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from leanlm_testing.scripts import script_fixture

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "gpu_compile.py"


tool = script_fixture(TOOL, "gpu_compile_under_test")


def _record(**kw):
    base = {
        "kernel": "pkg._kernels:_k", "arch": "sm_80", "config": {"BLOCK": 64}, "ok": True,
        "error": None, "registers": 64, "spills": 0, "shared_bytes": 16384, "num_stages": 3,
        "pipeline_buffers": 2, "uses_dot": True, "tensor_core": True,
    }  # fmt: skip
    return {**base, **kw}


def test_gate_passes_a_clean_record_and_flags_each_violation(tool):
    assert tool.gate([_record(), _record(arch="sm_90", uses_dot=False, tensor_core=False)]) == []
    cases = {
        "compile error": _record(ok=False, error="CompilationError: boom"),
        "spills 8 bytes": _record(spills=8),
        "shared memory 200000 > 166912": _record(shared_bytes=200_000),
        "tl.dot without tensor-core": _record(tensor_core=False),
        "not pipelined (num_stages 1": _record(num_stages=1),
        "not pipelined (num_stages 3, 1 buffer": _record(pipeline_buffers=1),
    }
    for expected, record in cases.items():
        failures = tool.gate([record])
        assert len(failures) == 1, (expected, failures)
        assert expected in failures[0], (expected, failures)
    # sm_90 allows 227 KB: 200 000 bytes pass there
    assert tool.gate([_record(arch="sm_90", shared_bytes=200_000)]) == []


def test_gate_on_the_fp32_dot_precision_a_launch_asks_for(tool):
    ieee = {"BLOCK": 64, "PRECISION": "ieee"}
    # exact fp32 cannot run on tensor cores: allowed off them when the launch asks for it
    assert tool.gate([_record(config=ieee, tensor_core=False, input_precision="ieee")]) == []
    tf32 = {"BLOCK": 64, "PRECISION": "tf32"}
    assert tool.gate([_record(config=tf32, input_precision="tf32")]) == []
    # a dot compiled at another precision than asked, and a TF32 dot off the tensor cores
    failures = tool.gate([_record(config=ieee, tensor_core=True, input_precision="tf32")])
    assert failures == [f"fp32 tl.dot compiled as 'tf32', the launch asks 'ieee': "
                        f"pkg._kernels:_k sm_80 {ieee}"]  # fmt: skip
    failures = tool.gate([_record(config=tf32, tensor_core=False, input_precision="tf32")])
    assert len(failures) == 1
    assert "tl.dot without tensor-core" in failures[0]


TOY = """
import torch
import triton
import triton.language as tl


@triton.jit
def _fp32_dot_kernel(a_ptr, b_ptr, c_ptr, K, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        a = tl.load(a_ptr + offs[:, None] * K + k0 + offs[None, :])
        b = tl.load(b_ptr + (k0 + offs[:, None]) * BLOCK + offs[None, :])
        acc += tl.dot(a, b, input_precision="ieee")  # FMA path: no tensor cores
    tl.store(c_ptr + offs[:, None] * BLOCK + offs[None, :], acc)


@triton.jit
def _asked_dot_kernel(a_ptr, b_ptr, c_ptr, K, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        a = tl.load(a_ptr + offs[:, None] * K + k0 + offs[None, :])
        b = tl.load(b_ptr + (k0 + offs[:, None]) * BLOCK + offs[None, :])
        acc += tl.dot(a, b, input_precision=PRECISION)
    tl.store(c_ptr + offs[:, None] * BLOCK + offs[None, :], acc)


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _spill_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    # 2048 values live across two reductions on one warp, capped at 32 registers: spills
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    d = x - tl.sum(x, axis=0) / BLOCK
    tl.store(y_ptr + offs, d * tl.rsqrt(tl.sum(d * d, axis=0) / BLOCK + 1e-5) + x)


def launch(a, b, c, x, y):
    _fp32_dot_kernel[(1,)](a, b, c, a.shape[1], BLOCK=32)
    _copy_kernel[(1,)](x, y, x.numel(), BLOCK=1024)
    _spill_kernel[(1,)](x, y, BLOCK=2048, num_warps=1, maxnreg=32)
{extra}

def gpu_launch_configs():
    f32 = torch.float32
    return [
        {{"kernel": _fp32_dot_kernel, "options": {{"num_warps": 4, "num_stages": 3}},
          "args": {{"a_ptr": f32, "b_ptr": f32, "c_ptr": f32, "K": 256, "BLOCK": 32}}}},
        *({{"kernel": _asked_dot_kernel, "options": {{"num_warps": 4, "num_stages": 3}},
           "args": {{"a_ptr": f32, "b_ptr": f32, "c_ptr": f32, "K": 256, "BLOCK": 64,
                    "PRECISION": p}}}} for p in ("ieee", "tf32")),
        {{"kernel": _copy_kernel, "options": {{"num_warps": 4}},
          "args": {{"x_ptr": f32, "y_ptr": f32, "n": 4096, "BLOCK": 1024}}}},
        {{"kernel": _spill_kernel, "options": {{"num_warps": 1, "maxnreg": 32}},
          "args": {{"x_ptr": f32, "y_ptr": f32, "BLOCK": 2048}}}},
    ]
"""


def _toy_package(root: Path, extra: str = "", source: str = TOY) -> Path:
    pkg = root / "packages" / "toy"
    (pkg / "src" / "toy_kernels").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text('[project]\nname = "toy"\n')
    (pkg / "src" / "toy_kernels" / "__init__.py").write_text("")
    (pkg / "src" / "toy_kernels" / "_kernels.py").write_text(source.format(extra=extra))
    return pkg


def _run_tool(pkg: Path, out: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(pkg / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(TOOL), "--out", str(out), "--packages", str(pkg), "--jobs", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)


def test_real_compile_flags_a_dot_without_tensor_cores_and_a_spill(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "records.json"
    proc = _run_tool(_toy_package(tmp_path), out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    records = json.loads(out.read_text())["records"]
    by_key = {
        (r["kernel"].split(":")[1], r["config"].get("PRECISION"), r["arch"]): r for r in records
    }
    kernels = [("_fp32_dot_kernel", None), ("_copy_kernel", None), ("_spill_kernel", None)]
    kernels += [("_asked_dot_kernel", "ieee"), ("_asked_dot_kernel", "tf32")]
    assert set(by_key) == {(*k, a) for k in kernels for a in ("sm_80", "sm_90")}
    for arch in ("sm_80", "sm_90"):
        dot, copy = by_key["_fp32_dot_kernel", None, arch], by_key["_copy_kernel", None, arch]
        assert dot["ok"]
        assert copy["ok"]
        assert dot["uses_dot"]
        assert not dot["tensor_core"]
        assert dot["input_precision"] == "ieee"
        assert not dot["wgmma"]
        assert not dot["tma"]
        ieee, tf32 = (by_key["_asked_dot_kernel", p, arch] for p in ("ieee", "tf32"))
        assert (ieee["input_precision"], tf32["input_precision"]) == ("ieee", "tf32")
        assert not ieee["tensor_core"]  # passes the gate: the launch asks for IEEE
        assert tf32["tensor_core"]
        assert tf32["wgmma"] == (arch == "sm_90")
        assert not tf32["tma"]  # pointer loads, no tensor descriptors
        assert not copy["uses_dot"]
        assert copy["input_precision"] is None
        assert copy["registers"] > 0
        assert copy["spills"] == 0
        spill = by_key["_spill_kernel", None, arch]
        assert spill["registers"] <= 32
        assert spill["spills"] > 0
    assert proc.stdout.count("FAIL tl.dot without tensor-core instructions") == 2
    assert proc.stdout.count("FAIL spills") == 2
    assert proc.stdout.count("FAIL") == 4  # the clean copy kernel passes


def test_a_launched_kernel_missing_from_the_configs_is_an_error(tmp_path):
    pytest.importorskip("triton")
    extra = textwrap.dedent("""
        @triton.jit
        def _forgotten_kernel(x_ptr):
            tl.store(x_ptr, 1.0)


        def launch_forgotten(x):
            _forgotten_kernel[(1,)](x)
    """)
    proc = _run_tool(_toy_package(tmp_path, extra), tmp_path / "records.json")
    assert proc.returncode != 0
    assert "launches _forgotten_kernel but gpu_launch_configs() omits it" in proc.stderr


def test_a_kernel_handed_to_a_shared_launcher_counts_as_launched(tool, tmp_path):
    src = tmp_path / "_kernels.py"
    src.write_text(
        textwrap.dedent("""
            @triton.jit
            def _helper(x):
                return x


            @triton.jit
            def _k(x_ptr):
                tl.store(x_ptr, _helper(1.0))


            def launch(kernel, x):
                kernel[(1,)](x)


            def run(x):
                tile = {"BLOCK": 64}
                return launch(_k if tile else None, x)
        """)
    )
    names = tool.launched_names(src)
    assert {"_k", "kernel", "launch"} <= names
    assert "_helper" not in names  # called only inside a kernel
    assert "tile" not in names  # a local name, not the module's


def test_gate_fails_a_compile_that_lost_what_its_launch_requires(tool):
    hopper = {"arch": "sm_90", "requires": ["tma", "wgmma"]}
    assert tool.gate([_record(**hopper, tma=True, wgmma=True)]) == []
    failures = tool.gate([_record(**hopper, tma=False, wgmma=True)])
    assert len(failures) == 1
    assert failures[0].startswith("tma required by the launch but not in the compile")


# ld.global (predicated, 16 B), a per-row factor (one narrow access), a scalar stream (four 2 B
# loads of one site in a loop block), a 1-D vector site (four 4 B loads), a tile site with two
# narrow loads, four narrow copies of one site split by commit_groups (pipeline stages), and
# narrow stores outside any loop
_PTX = """
\t.loc\t1 5 10                         // k.py:5:10
\tld.global.b64 { %rd1 }, [ %rd2 + 0 ];
\tst.global.b16 [ %rd3 + 0 ], { %rs1 };
\tst.global.b16 [ %rd3 + 2 ], { %rs1 };
\tst.global.b16 [ %rd3 + 4 ], { %rs1 };
\tst.global.b16 [ %rd3 + 6 ], { %rs1 };
$L__BB0_2:                              // %loop
                                        // =>This Inner Loop Header: Depth=1
\t.loc\t1 7 12                         // k.py:7:12
\t@%p1 ld.global.L1::evict_first.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd4 + 0 ];
\t.loc\t1 8 9                          // k.py:8:9
\tld.global.b32 { %r5 }, [ %rd5 + 0 ];
\t.loc\t1 9 9                          // _h.py:3:4 @[ k.py:9:9 ]
\t@%p2 ld.global.b16 { %rs2 }, [ %rd6 + 0 ];
\t@%p3 ld.global.b16 { %rs3 }, [ %rd6 + 2 ];
\t@%p3 ld.global.b16 { %rs3 }, [ %rd6 + 4 ];
\t@%p3 ld.global.b16 { %rs3 }, [ %rd6 + 6 ];
\t.loc\t1 11 9                         // k.py:11:9
\t@%p2 ld.global.b32 { %r9 }, [ %rd9 + 0 ];
\t@%p3 ld.global.b32 { %r10 }, [ %rd9 + 16 ];
\t@%p2 ld.global.b32 { %r9 }, [ %rd9 + 32 ];
\t@%p3 ld.global.b32 { %r10 }, [ %rd9 + 48 ];
\t.loc\t1 12 9                         // k.py:12:9
\t@%p2 ld.global.b32 { %r9 }, [ %rd10 + 0 ];
\t@%p3 ld.global.b32 { %r10 }, [ %rd10 + 4 ];
\t.loc\t1 10 9                         // k.py:10:9
\tcp.async.ca.shared.global [ %r6 + 0 ], [ %rd7 + 0 ], 0x4, %r7;
\tcp.async.commit_group;
\tcp.async.ca.shared.global [ %r8 + 0 ], [ %rd8 + 0 ], 0x4, %r7;
\tcp.async.commit_group;
\tcp.async.ca.shared.global [ %r8 + 0 ], [ %rd8 + 0 ], 0x4, %r7;
\tcp.async.commit_group;
\tcp.async.ca.shared.global [ %r8 + 0 ], [ %rd8 + 0 ], 0x4, %r7;
\tcp.async.commit_group;
\tcp.async.wait_group \t0;
\t@%p4 bra \t$L__BB0_2;
"""


def test_global_access_counts_widths_and_finds_scalar_streams(tool):
    counts, streams = tool.global_access(_PTX, {"k.py:11:9"})
    assert counts == {
        "cp.async.4": 4, "ld.global.b16": 4, "ld.global.b32": 7, "ld.global.b64": 1,
        "ld.global.v4.b32": 1, "st.global.b16": 4,
    }  # fmt: skip
    assert streams == ["_h.py:3:4 @[ k.py:9:9 ] (4 x 2 B)"]
    assert tool.global_access(_PTX, set())[1] == [*streams, "k.py:11:9 (4 x 4 B)"]
    record = _record(global_access=counts)
    assert tool.widths(record, "ld.global") == "16x1 8x1 4x7 2x4"
    assert (tool.widths(record, "st.global"), tool.widths(record, "cp.async")) == ("2x4", "4x4")
    assert tool.widths(_record(global_access={}), "ld.global") == "-"


_TTGIR = """
#loc = loc("/x/k.py":1:0)
module {
  tt.func public @k() {
    %a = tt.load %p, %m : tensor<8x!tt.ptr<f32>, #ttg.slice<{dim = 1, parent = #b}>> loc(#loc3)
    %b = ttg.async_copy_global_to_local %q : tensor<8x256x!tt.ptr<f32>, #b> -> <...> loc(#loc4)
    tt.store %s, %v : tensor<8x!tt.ptr<f32>, #b1> loc(#loc6)
    %c = tt.load %t : !tt.ptr<i64> loc(#loc7)
    %d = tt.load %u : tensor<4x!tt.ptr<f32>, #b1> loc(#loc9)
    %e = tt.load %w : tensor<4x4x!tt.ptr<bf16>, #b> loc(#loc10)
  } loc(#loc)
} loc(#loc)
#loc1 = loc("/x/k.py":8:9)
#loc2 = loc("/x/_h.py":3:4)
#loc3 = loc("r"(#loc1))
#loc4 = loc("g"(#loc5))
#loc5 = loc("/x/k.py":9:9)
#loc6 = loc(callsite(#loc2 at #loc1))
#loc7 = loc("/x/k.py":2:5)
#loc8 = loc("/x/_h.py":6:7)
#loc9 = loc(callsite(#loc8 at #loc1))
#loc10 = loc(callsite(#loc8 at #loc5))
"""


def test_vector_sites_are_the_positions_of_scalar_and_1d_accesses_only(tool):
    # _h.py:6:7 loads a 1-D vector at one call site and a 2-D tile at another: not exempt
    assert tool.vector_sites(_TTGIR) == {"k.py:8:9", "_h.py:3:4", "k.py:2:5"}


def test_gate_fails_a_scalar_stream_only_in_an_aligned_launch(tool):
    stream = ["k.py:9:9 (8 x 2 B)"]
    aligned, unaligned = {"ALIGNED": True, "SUB": 8}, {"ALIGNED": False, "SUB": 8}
    assert tool.gate([_record(config=aligned, scalar_streams=[])]) == []
    assert tool.gate([_record(config=unaligned, scalar_streams=stream)]) == []
    assert tool.gate([_record(scalar_streams=stream)]) == []  # no ALIGNED constexpr
    failures = tool.gate([_record(config=aligned, scalar_streams=stream)])
    assert failures == [f"scalar loads/stores in a loop of an ALIGNED launch: {stream[0]}: "
                        f"pkg._kernels:_k sm_80 {aligned}"]  # fmt: skip


# rows of a bf16 matrix scaled by a per-row factor; the row length, loaded from a table as the
# multi-tensor kernels load it, is hinted a multiple of 16 only under HINT: the aligned launch
# without the hint is the lost-hint bug (a hint on a value with no defining op is dropped too)
ROWS = """
import torch
import triton
import triton.language as tl


@triton.jit
def _scale_rows_kernel(x_ptr, f_ptr, y_ptr, rows, geo, ALIGNED: tl.constexpr,
                       HINT: tl.constexpr, SUB: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.load(geo)
    if HINT:
        n = tl.multiple_of(n, 16)
    for r0 in range(tl.program_id(0) * SUB, rows, SUB * tl.num_programs(0)):
        r = r0 + tl.arange(0, SUB)
        f = tl.load(f_ptr + r, mask=r < rows, other=0.0)  # one element per thread
        for c0 in range(0, n, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            mask = (r[:, None] < rows) & (c[None, :] < n)
            offs = r[:, None] * n + c[None, :]
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptr + offs, (x * f[:, None]).to(tl.bfloat16), mask=mask)


def launch(x, f, y, geo):
    _scale_rows_kernel[(4,)](x, f, y, x.shape[0], geo, ALIGNED=True, HINT=True, SUB=8,
                             BLOCK=128)
{extra}

def gpu_launch_configs():
    bf16, f32 = torch.bfloat16, torch.float32
    return [
        {{"kernel": _scale_rows_kernel, "options": {{"num_warps": 4}},
          "args": {{"x_ptr": bf16, "f_ptr": f32, "y_ptr": bf16, "rows": 64, "geo": torch.int32,
                   "ALIGNED": True, "HINT": hint, "SUB": 8, "BLOCK": 128}}}}
        for hint in (True, False)
    ]
"""


def test_real_compile_flags_an_aligned_launch_that_lost_its_hint(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "records.json"
    proc = _run_tool(_toy_package(tmp_path, source=ROWS), out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    records = {(r["config"]["HINT"], r["arch"]): r for r in json.loads(out.read_text())["records"]}
    assert len(records) == 4
    for arch in ("sm_80", "sm_90"):
        hinted, lost = records[True, arch], records[False, arch]
        assert hinted["ok"], hinted["error"]
        assert hinted["scalar_streams"] == []
        assert hinted["global_access"]["ld.global.v4.b32"] >= 1  # 8 bf16 per thread: 16 B
        assert hinted["global_access"]["st.global.v4.b32"] >= 1
        assert not any(k.endswith("b16") for k in hinted["global_access"])
        assert len(lost["scalar_streams"]) == 2, lost["scalar_streams"]  # the load and store
        assert all("(8 x 2 B)" in s for s in lost["scalar_streams"])
        assert lost["global_access"]["ld.global.b16"] == 8
    assert proc.stdout.count("FAIL scalar loads/stores in a loop of an ALIGNED launch") == 2
    assert proc.stdout.count("FAIL") == 2


# sparse-kernels' Hopper kernels as shipped, at 4095 tokens: forward and dX (dtype, block size),
# dW (dtype, block size, split-K or not)
_SM90 = """
import json, sys
sys.path.insert(0, sys.argv[1])
import gpu_compile as G
records, archs = [], set()
for module in ("sparse_kernels._bsr_hopper", "sparse_kernels._bsr_hopper_dw"):
    specs = G.load_specs(module)
    archs |= {a for s in specs for a in s["archs"]}
    records += [G.compile_one(module, i, arch) for i, s in enumerate(specs)
                if s["args"]["M"] % 16 for arch in s["archs"]]
print(json.dumps({"archs": sorted(archs), "records": records}))
"""


def test_sparse_kernels_sm90_configs_compile_with_tma_wgmma_and_3_stages(tool, tmp_path):
    """Every shipped Hopper config of sparse-kernels (`_bsr_hopper` and `_bsr_hopper_dw`
    `gpu_launch_configs`, sm_90 only; at the 4095-token specialization) compiles with TMA
    loads, wgmma, >= 3 shared-memory buffers, no spills, within 227 KB, and passes the gate
    (which also enforces `requires`)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # really compile
    proc = subprocess.run(
        [sys.executable, "-c", _SM90, str(TOOL.parent)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    records = result["records"]
    assert result["archs"] == ["sm_90"]
    # 3 dtypes x 2 block sizes x (forward, dX); dW: x (one pass, split-K with fp32 partials)
    assert len(records) == 12 + 12
    for r in records:
        assert r["ok"], r["error"]
        assert (r["tma"], r["wgmma"]) == (True, True), r["config"]
        assert r["pipeline_buffers"] >= 3, r["config"]
        assert r["spills"] == 0, r["config"]
        assert r["shared_bytes"] <= 227 * 1024, r["config"]
        assert r["requires"] == ["tma", "wgmma"]
    assert tool.gate(records) == []
