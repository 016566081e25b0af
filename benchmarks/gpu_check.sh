#!/usr/bin/env bash
# Kernel check on one GPU (H200), < 10 minutes:
#   1. tests/kernels compiled on the GPU (TestPallas picks interpret=False when a GPU is present),
#   2. tests/engine/test_step_memory.py: the whole step keeps the cache in place on the GPU,
#   3. the microbenchmark table (benchmarks/_kernel_bench_gpu.py): decode + mixed batches,
#      batch 1..256, context 512..32k, bfloat16 + fp8, vs jax's Pallas paged_attention and
#      the XLA backend.
#   4. benchmarks/async_ab.py: the engine with async scheduling off vs on, alternating passes of
#      32 greedy requests (host and device are separate here, unlike the CPU runs).
# Step 1 also runs tests/kernels/test_kv_write_pallas.py (the Triton KV-write kernel compiled on
# the GPU; its Mosaic variant is skipped) and test_mosaic_kernel.py, of which only the lowering
# tests run on a GPU (seconds; the Mosaic kernel itself is checked in TPU interpret mode on CPU).
# Usage: [GPU_CHECK_PARTS=tests,memory,bench,async] [GPU_CHECK_DRYRUN=1] benchmarks/gpu_check.sh [OUT_DIR]
#   (OUT_DIR default: $OUT, else benchmarks/results/; GPU_CHECK_PARTS default: all four).
# GPU_CHECK_DRYRUN=1: the same parts, commands and arguments on a machine WITHOUT a GPU, so
# that an API break or a typo shows before the run on a GPU. It needs the CUDA plugin wheels at
# jaxlib's version and ptxas (see jaxkv/gpu_aot.py). What needs a GPU is compiled for a
# compile-only H200 instead: 1. tests/kernels on CPU (interpret mode) plus the GPU cases of the
# kernel tests compiled (tests/gpu_aot/test_h200_kernel_tests.py); 2. the step-memory test on
# CPU plus the test of record on the H200 executables; 3. the benchmark's workloads compiled,
# not timed (--aot h200: kernels_gpu_aot_h200.json/md); 4. the async A/B on CPU. The dry run's
# timeouts are longer (CPU); its logs go to the same files, gpu_env.txt says "dry run". (CI=true
# on the tests/gpu_aot runs: a missing plugin fails them instead of skipping.)
# Worst case (every part at its timeout) is ~11 minutes; typical runs are shorter. Under a
# 600 s limit per command, run GPU_CHECK_PARTS=tests,memory,bench first, then GPU_CHECK_PARTS=async.
# Writes OUT_DIR/gpu_tests.log, gpu_step_memory.log, gpu_bench.log, kernels_gpu.json, kernels_gpu.md, gpu_env.txt,
# gpu_async_ab.log, async_ab_gpu.json.
# Exit status: non-zero if the tests failed or timed out, or the benchmark failed.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:-${OUT:-$REPO/benchmarks/results}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
cd "$REPO"
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
DRYRUN="${GPU_CHECK_DRYRUN:-0}"
case "$DRYRUN" in 0|1) ;;
  *) echo "gpu_check: GPU_CHECK_DRYRUN must be 0 or 1, got '$DRYRUN'" >&2; exit 2 ;;
esac
if [[ "$DRYRUN" == 1 ]]; then
  # The CUDA plugin registers without CUDA libraries (jaxkv.gpu_aot.prepare_environment).
  export JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1
fi
# Timeout of a part: the GPU run's, or the dry run's (everything runs or compiles on the CPU).
limit() { if [[ "$DRYRUN" == 1 ]]; then echo "$2"; else echo "$1"; fi; }

PARTS=",${GPU_CHECK_PARTS:-tests,memory,bench,async},"
for part in ${PARTS//,/ }; do
  case "$part" in tests|memory|bench|async) ;;
    *) echo "gpu_check: unknown part '$part' in GPU_CHECK_PARTS (tests, memory, bench, async)" >&2
       exit 2 ;;
  esac
done
want() { [[ "$PARTS" == *",$1,"* ]]; }

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  echo "parts: ${PARTS:1:-1}"
  [[ "$DRYRUN" == 1 ]] && echo "dry run (GPU_CHECK_DRYRUN=1): no GPU; compiled for a compile-only H200"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi unavailable"
} | tee -a "$OUT_DIR/gpu_env.txt"
if [[ "$DRYRUN" == 1 ]]; then
  if ! timeout 90 python -c '
import sys, jax
from jaxkv import gpu_aot
print("jax", jax.__version__, jax.default_backend(), jax.devices())
try:
    dev = gpu_aot.aot_device("h200")
except RuntimeError as e:
    sys.exit(f"gpu_check: {e}")
print("compile-only", dev.device_kind, dev.platform, "ptxas", gpu_aot.ptxas_path())
sys.exit(0 if gpu_aot.ptxas_path() else "gpu_check: no ptxas (pip install nvidia-cuda-nvcc-cu12)")' \
      | tee -a "$OUT_DIR/gpu_env.txt"; then
    echo "gpu_check: no compile-only H200; nothing to dry-run" >&2
    exit 2
  fi
elif ! timeout 90 python -c '
import sys, jax
print("jax", jax.__version__, jax.default_backend(), jax.devices())
sys.exit(0 if jax.default_backend() == "gpu" else 1)' | tee -a "$OUT_DIR/gpu_env.txt"; then
  echo "gpu_check: jax sees no GPU; nothing to check" >&2
  exit 2
fi

tests_rc=0
if want tests; then
(
  rc=0
  timeout --kill-after=10 "$(limit 300 1500)" python -m pytest tests/kernels -q -p no:cacheprovider \
    --durations=10 || rc=$?
  if [[ "$DRYRUN" == 1 ]]; then   # what the GPU run compiles, compiled for the H200
    CI=true timeout --kill-after=10 900 python -m pytest tests/gpu_aot/test_h200_kernel_tests.py -q \
      -p no:cacheprovider --durations=10 || rc=$?
  fi
  exit $rc
) > "$OUT_DIR/gpu_tests.log" 2>&1 || tests_rc=$?
tail -n 30 "$OUT_DIR/gpu_tests.log"
echo "gpu_check: kernel tests exit status $tests_rc (124 = timeout)"
fi

# The whole engine step on the GPU (auto backend = the Pallas kernel): the cache must stay in
# place. The Pallas path bitcasts the uint8 buffers to typed views before the pallas_call; if
# XLA:GPU materialises that bitcast, temp memory grows with the cache and this test fails.
mem_rc=0
if want memory; then
(
  rc=0
  timeout --kill-after=10 "$(limit 90 600)" python -m pytest tests/engine/test_step_memory.py -q \
    -p no:cacheprovider || rc=$?
  if [[ "$DRYRUN" == 1 ]]; then   # the same test on the H200 executables
    CI=true timeout --kill-after=10 900 python -m pytest tests/gpu_aot/test_h200_memory_and_kernels.py -q \
      -p no:cacheprovider -k test_step_updates_cache_in_place_on_h200 || rc=$?
  fi
  exit $rc
) > "$OUT_DIR/gpu_step_memory.log" 2>&1 || mem_rc=$?
tail -n 15 "$OUT_DIR/gpu_step_memory.log"
echo "gpu_check: step-memory test exit status $mem_rc (124 = timeout)"
fi

bench_rc=0
if want bench; then
bench_args=(--budget-s 150)
if [[ "$DRYRUN" == 1 ]]; then   # every workload compiled for the H200, not timed
  bench_args=(--budget-s 1000 --aot h200)
fi
timeout --kill-after=10 "$(limit 200 1200)" python benchmarks/_kernel_bench_gpu.py "$OUT_DIR" \
  "${bench_args[@]}" > "$OUT_DIR/gpu_bench.log" 2>&1 || bench_rc=$?
tail -n 40 "$OUT_DIR/gpu_bench.log"
echo "gpu_check: benchmark exit status $bench_rc (124 = timeout)"
fi

async_rc=0
if want async; then
timeout --kill-after=10 "$(limit 110 900)" python benchmarks/async_ab.py --requests 32 --max-tokens 32 --rounds 4 \
  --json "$OUT_DIR/async_ab_gpu.json" \
  > "$OUT_DIR/gpu_async_ab.log" 2>&1 || async_rc=$?
tail -n 12 "$OUT_DIR/gpu_async_ab.log"
echo "gpu_check: async A/B exit status $async_rc (124 = timeout)"
fi

if [[ $tests_rc -ne 0 || $mem_rc -ne 0 || $bench_rc -ne 0 || $async_rc -ne 0 ]]; then
  exit 1
fi
