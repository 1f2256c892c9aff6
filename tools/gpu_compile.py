#!/usr/bin/env python
"""Compile every launched Triton kernel for A100 (sm_80) and H100 (sm_90) without a GPU, and gate.

Usage: python tools/gpu_compile.py --out FILE.json [--markdown FILE.md] [--jobs 2] [--no-gate]

Discovery: every module under `packages/*/src` whose source contains `@triton.jit` must export
`gpu_launch_configs()`, a list of launches as the module's own launchers make them on a GPU:
`{"kernel": <JITFunction>, "args": {name: value}, "options": {"num_warps": .., "num_stages": ..}}`
with a `torch.dtype` in place of each tensor argument (a `TensorDescriptor` over a meta tensor for
a tensor-descriptor argument) and representative integers (whether an integer is a multiple of 16
changes the code Triton generates, so both cases are listed where both occur). Optional keys:
`"archs"` (the architectures the launch is made on, default all of ARCHS: a Hopper-only kernel
says `("sm_90",)`) and `"requires"` (record fields that must be true, e.g. `("tma", "wgmma")`:
the gate fails a compile that lost them). Every `@triton.jit` function the module launches
(`name[grid](...)`) must appear in it. The arguments go through Triton's own JIT binder and
specialization (`_pack_args`), then `triton.compile` for `GPUTarget("cuda", 80 | 90, 32)`,
exactly the path of a launch on that GPU. The wheel's `ptxas -v` gives registers and spills.

One JSON record per compile: kernel (`module:function`), arch, config, ok, error, registers,
spills (bytes stored + loaded), shared_bytes, num_stages (the launch option), pipeline_buffers
(buffers of the multi-buffered shared-memory operands in the TTGIR; 1 = not pipelined),
uses_dot (`tt.dot` in the TTIR), tensor_core (`mma.sync` on sm_80, `wgmma` or `mma` on sm_90 in
the PTX), wgmma (`wgmma.` in the PTX: Hopper warpgroup MMA), tma (`cp.async.bulk.tensor` in the
PTX: loads/stores through TMA descriptors), input_precision (of the `tt.dot`s with fp32
operands in the TTIR: "ieee" where it prints no `inputPrecision`, else its value, e.g. "tf32";
None without such a dot), global_access (static count of each global memory instruction shape
in the PTX: `ld.global.v4.b32` moves 16 B per thread, `ld.global.b16` 2 B, `cp.async.4` 4 B) and
scalar_streams (the tile load/store sites that move a thread's elements one by one in a loop,
`global_access`). The gate fails on a compile error, any spill, shared memory over the
arch's limit, a `tl.dot` without tensor-core instructions, a GEMM loop (a kernel with `tl.dot`)
launched with `num_stages` < 2 or not pipelined (fewer than 2 buffers), or an fp32 dot compiled
at another precision than the launch's `PRECISION` constexpr asks for, or a scalar stream in a
launch with `ALIGNED=True` (row length and base pointers hinted `tl.multiple_of` 16, so its
tiles must load and store as vectors of >= 8 B). A launch that asks for
`PRECISION="ieee"` (exact fp32, which tensor cores cannot do) may run its dots off the tensor
cores; tma and wgmma are recorded, and gated only where the launch `requires` them.

This is compile evidence, not a GPU run: it says what the compiler makes of the kernels, not
how fast or how correct they are. Needs no GPU and must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ARCHS = {"sm_80": 80, "sm_90": 90}
# Max dynamic shared memory per block (CUDA C programming guide, compute capabilities table):
# 163 KB on sm_80 (A100), 227 KB on sm_90 (H100).
SHARED_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
VECTOR_BYTES = 8  # narrower global accesses are scalar (one 1/2/4-byte element, or two 16-bit)
# A thread moving this many elements of one tile by narrow accesses is a scalar stream; the
# lost-hint bug moved all 8 of a thread's elements one by one (1-4 B each). Fewer are allowed:
# a [SUB, BLOCK_T] tile of row partials in rows of unaligned length (2 fp32 per thread).
SCALAR_RUN = 4
# `[@pred] ld.global|st.global|cp.async.<modifiers> operands` (not TMA's cp.async.bulk)
_GLOBAL = re.compile(r"^\s*(?:@!?%\w+\s+)?(ld\.global|st\.global|cp\.async)\.(\S+)\s+(.*)$")
# LLVM's loop comments on a block: "in Loop: Header=BB0_2 Depth=1", "Loop Header: Depth=2"
_LOOP_DEPTH = re.compile(r"Header(?:: |=\S+ )Depth=(\d+)")
_SPECS: dict[str, list[dict[str, Any]]] = {}  # module name -> gpu_launch_configs(), per process


# ------------------------------------------------------------------------------- discovery
def kernel_modules(roots: Iterable[Path]) -> list[tuple[str, Path]]:
    """(module name, file) of every source file under `<root>/src` that defines a Triton kernel."""
    found = []
    for root in roots:
        src = root / "src"
        for path in sorted(src.rglob("*.py")):
            if _defines_kernel(path):
                rel = path.relative_to(src).with_suffix("")
                found.append((".".join(rel.parts), path))
    return found


def _defines_kernel(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(
        ast.unparse(dec).startswith(("triton.jit", "triton.autotune", "triton.heuristics"))
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        for dec in node.decorator_list
    )


def launched_names(path: Path) -> set[str]:
    """The names a module may launch (`load_specs` keeps those that are its kernels).

    Each `name` of a `name[grid](...)`, and every name a plain (not `@triton.jit`) function
    reads, so that a kernel handed to a shared launcher (`launch(_kernel, ...)`) counts too.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Subscript)
            and isinstance(node.func.value, ast.Name)
        ):
            names.add(node.func.value.id)
        elif isinstance(node, ast.FunctionDef) and not any(
            "jit" in ast.unparse(d) for d in node.decorator_list
        ):
            used = [n for n in ast.walk(node) if isinstance(n, ast.Name)]
            local = {n.id for n in used if not isinstance(n.ctx, ast.Load)}
            names |= {n.id for n in used if n.id not in local}  # the module's names it reads
    return names


def load_specs(module_name: str, path: Path | None = None) -> list[dict[str, Any]]:
    """The module's `gpu_launch_configs()`, checked to cover every kernel it launches."""
    if module_name in _SPECS:
        return _SPECS[module_name]
    import triton

    module = importlib.import_module(module_name)
    if not hasattr(module, "gpu_launch_configs"):
        raise SystemExit(f"{module_name} defines @triton.jit kernels but no gpu_launch_configs()")
    specs: list[dict[str, Any]] = list(module.gpu_launch_configs())
    if path is not None:
        covered = {spec["kernel"].__name__ for spec in specs}
        for name in sorted(launched_names(path)):
            obj = getattr(module, name, None)
            if isinstance(obj, triton.runtime.jit.JITFunction) and name not in covered:
                raise SystemExit(f"{module_name} launches {name} but gpu_launch_configs() omits it")
    _SPECS[module_name] = specs
    return specs


# ------------------------------------------------------------------------------ one compile
def _config(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    config: dict[str, Any] = {}
    # tensor arguments and the tensors under tensor descriptors (`.base`)
    found = [getattr(getattr(v, "base", v), "dtype", v) for v in spec["args"].values()]
    dtypes = sorted({str(v).removeprefix("torch.") for v in found
                     if isinstance(v, torch.dtype) and v.is_floating_point})  # fmt: skip
    config["dtype"] = "/".join(dtypes)
    for name, value in spec["args"].items():
        if isinstance(value, (bool, str)) or (name.isupper() and isinstance(value, int)):
            config[name] = value
    # integer arguments Triton does not specialize as multiples of 16 (unaligned masks/strides)
    odd = [k for k, v in spec["args"].items() if type(v) is int and not k.isupper() and v % 16]
    config["not_div16"] = "+".join(odd) or "-"
    config.update(spec.get("options", {}))
    config.update(spec.get("note", {}))
    return config


def _ptxas(ptx: str, arch: str) -> tuple[int | None, int | None]:
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    gpu = "sm_90a" if arch == "sm_90" else arch
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "k.ptx"
        f.write_text(ptx)
        out = subprocess.run(
            [str(ptxas), "-v", "--gpu-name", gpu, str(f), "-o", os.devnull],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (
        int(regs.group(1)) if regs else None,
        int(spill.group(1)) + int(spill.group(2)) if spill else None,
    )


def compile_one(module_name: str, index: int, arch: str) -> dict[str, Any]:
    """Compile spec `index` of `module_name` for `arch` through Triton's JIT path; one record."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import MockTensor, create_function_from_signature

    spec = load_specs(module_name)[index]
    fn = spec["kernel"]
    record: dict[str, Any] = {
        "kernel": f"{module_name}:{fn.__name__}", "arch": arch, "config": _config(spec),
        "ok": False, "error": None, "registers": None, "spills": None, "shared_bytes": None,
        "num_stages": spec.get("options", {}).get("num_stages", 3), "pipeline_buffers": None,
        "uses_dot": None, "tensor_core": None, "wgmma": None, "tma": None, "input_precision": None,
        "global_access": None, "scalar_streams": None, "requires": list(spec.get("requires", ())),
    }  # fmt: skip
    try:
        target = GPUTarget("cuda", ARCHS[arch], 32)
        backend = CUDABackend(target)
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        args = {k: MockTensor.wrap_dtype(v) for k, v in spec["args"].items()}
        opts = dict(spec.get("options", {}))
        bound, specialization, options = binder(**args, **opts)
        options, signature, constexprs, attrs = fn._pack_args(
            backend, opts, bound, specialization, options
        )
        kernel = triton.compile(
            ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
        )
        ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
        record["num_stages"] = kernel.metadata.num_stages
        record["shared_bytes"] = kernel.metadata.shared
        record["uses_dot"] = "tt.dot " in kernel.asm["ttir"]
        tc = ("mma.sync",) if arch == "sm_80" else ("wgmma", "mma.sync")
        record["tensor_core"] = any(t in ptx for t in tc)
        record["wgmma"] = "wgmma." in ptx
        record["tma"] = "cp.async.bulk.tensor" in ptx
        record["input_precision"] = fp32_dot_precision(kernel.asm["ttir"])
        access = global_access(ptx, vector_sites(ttgir))
        record["global_access"], record["scalar_streams"] = access
        buffers = [int(b) for b in re.findall(r"!ttg\.memdesc<(\d+)x\d+x\d+x", ttgir)]
        record["pipeline_buffers"] = max(buffers, default=1)
        record["registers"], record["spills"] = _ptxas(ptx, arch)
        record["ok"] = True
    except Exception as exc:  # a compile error is a result, not a crash
        record["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
    return record


def fp32_dot_precision(ttir: str) -> str | None:
    """Input precision of the `tt.dot`s with fp32 operands in `ttir` ("/"-joined if they differ).

    The TTIR prints `inputPrecision = <p>` on a dot unless it is IEEE (the enum's default).
    """
    found = set()
    for line in ttir.splitlines():
        dot = re.search(r"tt\.dot .*: tensor<[0-9x]+x(\w+)>", line)
        if dot and dot.group(1) == "f32":
            precision = re.search(r"inputPrecision = (\w+)", line)
            found.add(precision.group(1) if precision else "ieee")
    return "/".join(sorted(found)) or None


def _shape(op: str, mods: str, operands: str) -> str:
    """Shape of one global memory instruction of the PTX: `ld.global.v4.b32`, `cp.async.16`."""
    if op == "cp.async":  # cp.async.ca.shared.global [dst], [src], cp-size[, src-size];
        return f"cp.async.{int(operands.split(',')[2].strip(' ;'), 0)}"
    parts = mods.split(".")
    vec = next((p for p in parts if re.fullmatch(r"v\d", p)), None)
    bits = next(p for p in reversed(parts) if re.fullmatch(r"[bsuf]\d+", p))
    return ".".join([op, *([vec] if vec else []), f"b{bits[1:]}"])


def shape_bytes(shape: str) -> int:
    """Bytes one thread moves with an instruction of `shape` (`_shape`)."""
    last = shape.rsplit(".", 1)[1]
    if shape.startswith("cp.async."):
        return int(last)
    vec = re.search(r"\.v(\d)\.", shape)
    return (int(vec.group(1)) if vec else 1) * int(last[1:]) // 8


def vector_sites(ttgir: str) -> set[str]:
    """`file:line:col` of the global loads/stores in the TTGIR of scalars and 1-D vectors only.

    A 1-D load of a per-row or per-column vector (a factor, a partial) is no element stream;
    a position that also loads or stores a 2-D (or higher) tile is not in the set. Positions
    are the innermost source position (inside any inlined helper), as the PTX's `.loc`
    comments print them.
    """
    locs = dict(re.findall(r"^(#loc\d*) = loc\((.*)\)$", ttgir, flags=re.M))

    def position(loc: str) -> str | None:
        while loc.startswith("#loc"):
            loc = locs.get(loc, "")
        if at := re.match(r'"([^"]+)":(\d+):(\d+)', loc):  # "file":line:col
            return f"{Path(at.group(1)).name}:{at.group(2)}:{at.group(3)}"
        inner = re.match(r'(?:"[^"]*"\(|callsite\(|fused\[)(#loc\d*)', loc)  # name(, callee
        return position(inner.group(1)) if inner else None

    ops = r"(?:tt\.load|tt\.store|ttg\.async_copy_global_to_local) .* loc\((#loc\d*)\)$"
    by_rank: dict[bool, set[str | None]] = {True: set(), False: set()}
    for op in re.finditer(ops, ttgir, flags=re.M):
        shape = re.search(r"tensor<([\dx]+)x!tt\.ptr", op.group(0))
        by_rank[shape is not None and "x" in shape.group(1)].add(position(op.group(1)))
    return {p for p in by_rank[False] - by_rank[True] if p}


def global_access(ptx: str, vectors: set[str]) -> tuple[dict[str, int], list[str]]:
    """(count per global memory instruction shape, scalar streams) of a kernel's PTX.

    A scalar stream is a load/store site (the source position of its `tl.load`/`tl.store`, with
    the call sites it was inlined at, from the PTX's `.loc` comments) that issues SCALAR_RUN or
    more accesses narrower than VECTOR_BYTES in one pipeline stage (between
    `cp.async.commit_group`s) of one basic block inside a loop: a thread holding several
    elements of it moves them one by one, which is what a lost `tl.multiple_of` hint compiles
    to. A site of `vectors` (`vector_sites`: per-row and per-column factors, whose elements a
    thread holds are neither contiguous nor aligned) is never one.
    """
    counts: dict[str, int] = {}
    narrow: dict[tuple[int, str], list[int]] = {}  # (stage, site) -> widths of its accesses
    site, depth, stage = "?", 0, 0
    for line in ptx.splitlines():
        text = line.strip()
        if text.startswith("$L__BB") or text.startswith("cp.async.commit_group"):
            stage += 1
            depth = depth if text.startswith("cp.async") else 0
        elif text.startswith("//") and (loop := _LOOP_DEPTH.search(text)):
            depth = max(depth, int(loop.group(1)))
        elif text.startswith(".loc"):
            site = text.split("//", 1)[1].strip() if "//" in text else text
        elif (found := _GLOBAL.match(line)) and (
            found.group(1) != "cp.async" or ".shared.global" in f".{found.group(2)}"
        ):  # a global load/store, or an asynchronous copy global -> shared (not wait/commit)
            shape = _shape(*found.groups())
            nbytes = shape_bytes(shape)
            counts[shape] = counts.get(shape, 0) + 1
            if depth and nbytes < VECTOR_BYTES:
                narrow.setdefault((stage, site), []).append(nbytes)
    streams = {
        f"{site} ({len(w)} x {max(w)} B)"
        for (_, site), w in narrow.items()
        if len(w) >= SCALAR_RUN and site.split(" @[")[0] not in vectors
    }
    return dict(sorted(counts.items())), sorted(streams)


# -------------------------------------------------------------------------------------- gate
def gate(records: list[dict[str, Any]]) -> list[str]:
    """One line per violation; empty when every compile passes."""
    bad = []
    for r in records:
        where = f"{r['kernel']} {r['arch']} {r['config']}"
        if not r["ok"]:
            bad.append(f"compile error: {where}: {r['error']}")
            continue
        if r["spills"]:
            bad.append(f"spills {r['spills']} bytes ({r['registers']} registers): {where}")
        limit = SHARED_LIMIT[r["arch"]]
        if r["shared_bytes"] > limit:
            bad.append(f"shared memory {r['shared_bytes']} > {limit} bytes: {where}")
        asked = r["config"].get("PRECISION")
        compiled = r.get("input_precision")
        if asked is not None and compiled is not None and compiled != asked:
            bad.append(f"fp32 tl.dot compiled as {compiled!r}, the launch asks {asked!r}: {where}")
        if r["uses_dot"] and not r["tensor_core"] and not (asked == compiled == "ieee"):
            bad.append(f"tl.dot without tensor-core instructions in the PTX: {where}")
        if r["uses_dot"] and (r["num_stages"] < 2 or r["pipeline_buffers"] < 2):
            bad.append(
                f"GEMM loop not pipelined (num_stages {r['num_stages']}, "
                f"{r['pipeline_buffers']} buffer(s)): {where}"
            )
        if r["config"].get("ALIGNED") is True and r.get("scalar_streams"):
            streams = "; ".join(r["scalar_streams"])
            bad.append(f"scalar loads/stores in a loop of an ALIGNED launch: {streams}: {where}")
        for flag in r.get("requires", ()):
            if not r.get(flag):
                bad.append(f"{flag} required by the launch but not in the compile: {where}")
    return bad


def markdown(records: list[dict[str, Any]]) -> str:
    """The records as a markdown table."""
    lines = [
        "| kernel | arch | config | ok | regs | spills | shared B | stages | buffers | dot | TC "
        "| wgmma | TMA | fp32 dot | ld.global B | st.global B | cp.async B | scalar streams |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items())
        dot = {True: "yes", False: "no", None: "?"}
        lines.append(
            f"| `{r['kernel']}` | {r['arch']} | {cfg} | {'yes' if r['ok'] else 'NO'} | "
            f"{r['registers']} | {r['spills']} | {r['shared_bytes']} | {r['num_stages']} | "
            f"{r['pipeline_buffers']} | {dot[r['uses_dot']]} | "
            f"{dot[r['tensor_core']] if r['uses_dot'] else '-'} | {dot[r.get('wgmma')]} | "
            f"{dot[r.get('tma')]} | {r.get('input_precision') or '-'} | "
            + " | ".join(widths(r, op) for op in ("ld.global", "st.global", "cp.async"))
            + f" | {len(r['scalar_streams']) if r.get('scalar_streams') is not None else '-'} |"
        )
    return "\n".join(lines) + "\n"


def widths(record: dict[str, Any], op: str) -> str:
    """`op`'s instructions in `record` by bytes per thread, widest first: "16x3 4x1" (- if none)."""
    by_bytes: dict[int, int] = {}
    for shape, n in (record.get("global_access") or {}).items():
        if shape.startswith(op + "."):
            by_bytes[shape_bytes(shape)] = by_bytes.get(shape_bytes(shape), 0) + n
    return " ".join(f"{b}x{n}" for b, n in sorted(by_bytes.items(), reverse=True)) or "-"


def summary(records: list[dict[str, Any]], prefix: str = "") -> str:
    """One markdown row per kernel and arch (modules starting with `prefix`).

    Launches compiled, and the worst registers, spills, shared memory and pipelining over them;
    tensor cores over the dots not asked to be IEEE fp32; how many GEMM launches compiled with
    wgmma and with TMA; the precisions of the fp32 dots; the widths of the global loads,
    stores and async copies (bytes per thread per instruction); the launches with scalar streams.
    """
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        if r["kernel"].startswith(prefix):
            rows.setdefault((r["kernel"], r["arch"]), []).append(r)
    lines = [
        "| kernel | arch | launches | compiled | max regs | spills (B) | max shared (KB) | "
        "min buffers | tensor cores | wgmma | TMA | fp32 dot | ld/st/cp B | scalar streams |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (kernel, arch), rs in rows.items():
        ok = [r for r in rs if r["ok"]]
        dots = [r for r in ok if r["uses_dot"]]
        mma = [r for r in dots if r.get("input_precision") != "ieee"]
        tc = "-" if not mma else "all" if all(r["tensor_core"] for r in mma) else "NOT all"
        buffers = min((r["pipeline_buffers"] for r in dots), default=None)
        wgmma, tma = (f"{sum(bool(r.get(k)) for r in dots)}/{len(dots)}" for k in ("wgmma", "tma"))
        fp32 = "/".join(sorted({r["input_precision"] for r in dots if r.get("input_precision")}))
        shapes = {k for r in ok for k in r.get("global_access") or {}}
        lines.append(
            f"| `{kernel}` | {arch} | {len(rs)} | {len(ok)} | "
            f"{max((r['registers'] for r in ok), default='-')} | "
            f"{max((r['spills'] for r in ok), default='-')} | "
            f"{max((r['shared_bytes'] for r in ok), default=0) / 1024:.0f} | "
            f"{'-' if buffers is None else buffers} | {tc} | "
            f"{wgmma if dots else '-'} | {tma if dots else '-'} | {fp32 or '-'} | "
            f"{'/'.join(map(str, sorted({shape_bytes(k) for k in shapes}))) or '-'} | "
            f"{sum(bool(r.get('scalar_streams')) for r in ok)}/{len(ok)} |"
        )
    return "\n".join(lines) + "\n"


def _run_job(job: tuple[str, int, str]) -> dict[str, Any]:
    return compile_one(*job)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file of the records")
    parser.add_argument("--markdown", type=Path, help="also write the markdown table here")
    parser.add_argument("--summary", type=Path, help="also write a per-kernel summary here")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--no-gate", action="store_true", help="report only, exit 0")
    parser.add_argument(
        "--packages", type=Path, nargs="*", help="package dirs (default: packages/*)"
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET: the interpreter replaces the compiler")
    if os.environ.get("TRITON_DISABLE_LINE_INFO") == "1":
        raise SystemExit("run without TRITON_DISABLE_LINE_INFO: scalar_streams reads PTX .loc")
    roots = args.packages or sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml"))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        # a fresh Triton cache: every run really compiles, nothing is kept
        os.environ["TRITON_CACHE_DIR"] = cache
        jobs: list[tuple[str, int, str]] = []
        for name, path in kernel_modules(roots):
            for i, spec in enumerate(load_specs(name, path)):
                jobs.extend((name, i, arch) for arch in spec.get("archs", ARCHS))
        if args.jobs > 1:
            with ProcessPoolExecutor(args.jobs, mp_context=get_context("fork")) as pool:
                records = list(pool.map(_run_job, jobs))
        else:
            records = [_run_job(job) for job in jobs]
    import triton

    elapsed = time.perf_counter() - start
    result = {"triton": triton.__version__, "seconds": round(elapsed, 1), "records": records}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(records)
    if args.markdown:
        args.markdown.write_text(table)
    if args.summary:
        args.summary.write_text(summary(records))
    print(table)
    failures = gate(records)
    print(f"{len(records)} compiles with triton {triton.__version__} in {elapsed:.1f} s; "
          f"{len(failures)} gate failure(s)")  # fmt: skip
    for line in failures:
        print("FAIL", line)
    return 0 if args.no_gate or not failures else 1


if __name__ == "__main__":
    sys.exit(main())
