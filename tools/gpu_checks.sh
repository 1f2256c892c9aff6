#!/usr/bin/env bash
# Every GPU check of the repo in one call, for a session that is lent a GPU machine (the `device`
# tool: 15 device minutes per session, one call at a time, a bare machine each start):
#
#     run(command="bash tools/gpu_checks.sh", carry=[".whl"], timeout_s=595)
#
# The steps' limits add up to 580 s; the steps of 2026-11-27 took about 6 minutes on an H100.
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
# bitsandbytes (optimizer-step's AdamW8bit row; 43 MB of the 64 MiB `carry` allows).
# `.venv/bin/pip download --no-deps lazy-loader==0.6 bitsandbytes==0.50.2 -d .whl`, then run with
# carry=[".whl"].
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
# costs its own tests only. `-v` logs each test's result as it ends, so a step cut by its limit
# still says which tests passed (it has 5 more since 2026-11-28: bf16/int8 first moments at real
# sizes, whose kernels compile here first).
plugin=(-p leanlm_testing.pytest_plugin)
if "$PY" -c 'import importlib.metadata as m, sys
sys.exit(not any(e.value == "leanlm_testing.pytest_plugin" for e in m.entry_points(group="pytest11")))'
then
  plugin=()
fi
step tests 110 "$PY" -m pytest "${plugin[@]}" -o minversion=7.0 -W default \
  --continue-on-collection-errors -m gpu -v -rfE --durations=15 packages/optim-adafactor/tests \
  packages/optim-came/tests packages/prune-distill/tests packages/shard-zero/tests \
  packages/sparse-kernels/tests packages/leanlm-testing/tests

# Benchmarks in their CUDA mode, settings that fit (2026-11-27 on an H100 each took about half
# its limit: tests 74 s, came ~95 s (59 s at --repeats 3, second run), kl ~75 s, world1 86 s,
# sparse 23 s, adafactor 22 s; the optimizer-step bench is new, ~35 s expected). Each
# prints device and versions first. On CPU (the dry run) some outlive their limits. bench-kl
# (fused KL vs Liger) ran on two H100s and is settled; its time went to the sparse steps below.
step bench-came 75 "$PY" packages/optim-came/benchmarks/bench_came.py --device "$DEVICE" \
  --repeats 3
# Issue 23's whole-step target: the 1.1B TinyLlama shape (bf16), each optimizer against fused AdamW,
# interleaved rounds (CPU: a tiny Llama); issue 29's int8 CAME and bitsandbytes' AdamW8bit included,
# and came-r16: CAME with the multi-tensor row items of before 7b70ad0 (16-row down_proj items), so
# that one run says whether 7b70ad0's shorter items (8 rows, +3% computed bytes) are faster.
step optimizer-step 70 "$PY" packages/leanlm/benchmarks/bench_optimizer_step.py --device "$DEVICE" \
  --rounds 5 --optimizers adamw came came-r16 came-fp32 came-int8 adafactor adamw8bit
step bench-adafactor 30 "$PY" packages/optim-adafactor/benchmarks/bench_adafactor.py \
  --device "$DEVICE" --repeats 5
# Then the 50% rows again replayed from CUDA graphs: graph replay has no host work per call, so
# replay ~ plain says a row is device-bound, replay much faster says host-bound (issue 24's decode
# rows and the sm90 per-call floor); --kernel-times adds each call's kernel µs (profiler), so
# replay time vs kernel time says what is left outside the kernels even without the host. Then bench_24.py: torch's 2:4 path split into its suspects
# (library, forced CUTLASS, direct cuSPARSELt with alg 0 / searched, per-call compression; kernels
# per call from the profiler): why 2:4 ran at 0.10-0.35x cuBLAS. Its log lines follow bench-sparse's
# (`run` brings back 8 files).
# Last, issue 24's remaining rows (GPT-13B's 5120->20480 MLP, and 8192 tokens; ~40 s expected),
# so that a step cut by its limit keeps the earlier tables.
step bench-sparse 90 bash -c '"$0" packages/sparse-kernels/benchmarks/bench_sparse.py --device "$1" \
  --shapes 4096x4096,4096x14336 --blocks 64 128 --prefill-tokens 4096 --decode-tokens 1 16 --rep-ms 40 \
  && "$0" packages/sparse-kernels/benchmarks/bench_sparse.py --device "$1" --blocks 128 64 \
  --shapes 4096x4096,4096x14336 --sparsities 0.5 --prefill-tokens 4096 --decode-tokens 1 16 --no-24 \
  --rep-ms 25 --cuda-graphs --kernel-times; \
  "$0" packages/sparse-kernels/benchmarks/bench_24.py --device "$1"; \
  "$0" packages/sparse-kernels/benchmarks/bench_sparse.py --device "$1" --shapes 5120x20480,4096x14336 \
  --blocks 128 64 --sparsities 0.5 0.75 --prefill-tokens 4096 8192 --decode-tokens 1 32 --no-24 \
  --rep-ms 25' "$PY" "$DEVICE"
# The sparsify stage's fine-tune, dense vs masked vs block-sparse layers (tokens/s, peak memory).
step sparse-finetune 75 "$PY" packages/leanlm/benchmarks/bench_sparse_finetune.py --device "$DEVICE"
# Each engine at world 1 in a fresh process (1.1B on a GPU); zero3's allocator trace replayed
# to its peak; one more profiled step per engine (launches, kernel time, top kernels: is stage 2's
# extra time host work or kernels, issue 25). `plain` (measured twice) left out for the time.
# Engines run one after another in ONE process measure each other's leftovers.
step world1 100 "$PY" packages/shard-zero/benchmarks/bench_world1.py \
  --engines fsdp2,zero2,zero3 --steps 5 --warmup 2 --snapshot zero3 --profile fsdp2,zero2,zero3 \
  --timeout 45
cat "$OUT/summary.txt"
