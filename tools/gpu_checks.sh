#!/usr/bin/env bash
# Every GPU check of the repo in one call, for a session that is lent a GPU machine (the `device`
# tool: 15 device minutes per session, one call at a time, a bare machine each start):
#
#     run(command="bash tools/gpu_checks.sh", carry=[".whl"], timeout_s=595)
#
# The steps' limits add up to 565 s; the same steps took about 6 minutes on an H100 (2026-11-27).
#
# Only the carried wheels below are installed (into a folder); the packages are imported from packages/*/src
# through PYTHONPATH, on the machine's own torch, triton and transformers (their versions are
# the env lines of summary.txt; they are not the pinned CPU ones). Each step has its own time
# limit, so a hang or a failure costs that step, not the call. Output goes to $OUT (what `run`
# brings back; default ./gpu-out): summary.txt (every step's command, exit code, seconds and
# last lines) and one log per step. Record what the logs show in the packages' RESULTS.md with
# the device and versions, and say which card gave each number.
#
# GPU_CHECKS_DEVICE=cpu runs the same steps on this machine (the gpu tests skip, the
# benchmarks run their CPU mode): a dry run of the script itself.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECKS_DEVICE:-cuda}
PYTHONPATH=$(printf '%s:' "$PWD"/packages/*/src)${PYTHONPATH:-}
export PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false

# Pure-Python wheels carried in the ignored .whl/ folder (the GPU machine reaches no index):
# lazy-loader (prune-distill's and sparse-kernels' runtime dependency, if that machine lacks it) and
# liger-kernel (bench-kl's comparison rows). `.venv/bin/pip download --no-deps lazy-loader==0.6
# liger-kernel==0.8.5 -d .whl`, then run with carry=[".whl"].
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-checks-site .whl/*.whl \
    && PYTHONPATH=$PYTHONPATH:/tmp/gpu-checks-site
fi
"$PY" -c 'import lazy_loader' 2>/dev/null \
  || echo "lazy_loader is missing: prune-distill and sparse-kernels will not import (carry .whl/)" >>"$OUT/summary.txt"

step() { # step NAME SECONDS COMMAND...: run COMMAND into $OUT/NAME.log within SECONDS
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s): $*" >>"$OUT/summary.txt"
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc after $((SECONDS - start)) s" >>"$OUT/summary.txt"
  tail -n 4 "$OUT/$name.log" | sed 's/^/   | /' >>"$OUT/summary.txt"
}

step env 30 "$PY" -c '
import platform, torch, triton, transformers
print("python", platform.python_version(), "torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__)
print("cuda", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "-")'
# `run` brings back at most 8 files: summary.txt and one log per step below (7), so env's lines
# go into summary.txt.
cat "$OUT/env.log" >>"$OUT/summary.txt" && rm -f "$OUT/env.log"

# The `gpu`-marked tests of every package (Triton kernels against their PyTorch references at the
# shipped tiles, shard-zero world 1 on CUDA, the KL kernel). The plugin is named explicitly when
# no installed entry point loads it (nothing is installed on the GPU machine); warnings are
# shown, not raised (other library versions than CI's); pytest may be older than the repo's
# minimum; a test module that cannot be imported there (came-pytorch is not on that machine)
# costs its own tests only.
plugin=(-p leanlm_testing.pytest_plugin)
if "$PY" -c 'import importlib.metadata as m, sys
sys.exit(not any(e.value == "leanlm_testing.pytest_plugin" for e in m.entry_points(group="pytest11")))'
then
  plugin=()
fi
step tests 120 "$PY" -m pytest "${plugin[@]}" -o minversion=7.0 -W default \
  --continue-on-collection-errors -m gpu -q -rfE --durations=15 packages/optim-adafactor/tests \
  packages/optim-came/tests packages/prune-distill/tests packages/shard-zero/tests \
  packages/sparse-kernels/tests packages/leanlm-testing/tests

# Benchmarks in their CUDA mode, settings that fit (2026-11-27 on an H100 each took about half
# its limit: tests 74 s, came ~95 s (59 s at --repeats 3, second run), kl ~75 s, world1 86 s,
# sparse 23 s, adafactor 22 s; the optimizer-step bench is new, ~35 s expected). Each
# prints device and versions first. On CPU (the dry run) some outlive their limits.
step bench-came 80 "$PY" packages/optim-came/benchmarks/bench_came.py --device "$DEVICE" \
  --repeats 3
# Issue 23's whole-step target: the 1.1B TinyLlama shape (bf16), each optimizer against fused AdamW,
# interleaved rounds (CPU: a tiny Llama).
step optimizer-step 60 "$PY" packages/leanlm/benchmarks/bench_optimizer_step.py --device "$DEVICE" \
  --rounds 5
step bench-adafactor 35 "$PY" packages/optim-adafactor/benchmarks/bench_adafactor.py \
  --device "$DEVICE" --repeats 5
step bench-sparse 45 "$PY" packages/sparse-kernels/benchmarks/bench_sparse.py --device "$DEVICE" \
  --blocks 64 128 --prefill-tokens 4096 --decode-tokens 1 --rep-ms 40
# Each engine at world 1 in a fresh process (1.1B on a GPU); zero3's allocator trace replayed
# to its peak. Engines run one after another in ONE process measure each other's leftovers.
step world1 100 "$PY" packages/shard-zero/benchmarks/bench_world1.py \
  --engines plain,fsdp2,zero2,zero3 --steps 5 --warmup 2 --snapshot zero3 --timeout 45
# Liger-Kernel rows run only where liger_kernel imports: carry its wheel (the device README's
# `.whl` recipe; liger-kernel 0.8.5 is pure Python) to compare at the Llama-3 vocabulary. With
# Liger, forward KL alone fills this limit (its 5 rows; JSD took 42 s more on the 2nd H100 run).
step bench-kl 95 "$PY" packages/prune-distill/benchmarks/bench_kl.py --device "$DEVICE" \
  --tokens 8192 --vocab 128256 --dtype bfloat16 --chunks 1024 --loss forward_kl \
  --repeats 2
cat "$OUT/summary.txt"
