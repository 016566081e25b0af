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
# Usage: [GPU_CHECK_PARTS=tests,memory,bench,async] benchmarks/gpu_check.sh [OUT_DIR]
#   (OUT_DIR default: $OUT, else benchmarks/results/; GPU_CHECK_PARTS default: all four).
# Worst case (every part at its timeout) is ~11 minutes; typical runs are shorter. Under a
# 600 s limit per call, run GPU_CHECK_PARTS=tests,memory,bench first, then GPU_CHECK_PARTS=async.
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
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi unavailable"
} | tee -a "$OUT_DIR/gpu_env.txt"
if ! timeout 90 python -c '
import sys, jax
print("jax", jax.__version__, jax.default_backend(), jax.devices())
sys.exit(0 if jax.default_backend() == "gpu" else 1)' | tee -a "$OUT_DIR/gpu_env.txt"; then
  echo "gpu_check: jax sees no GPU; nothing to check" >&2
  exit 2
fi

tests_rc=0
if want tests; then
timeout --kill-after=10 180 python -m pytest tests/kernels -q -p no:cacheprovider \
  --durations=10 > "$OUT_DIR/gpu_tests.log" 2>&1 || tests_rc=$?
tail -n 30 "$OUT_DIR/gpu_tests.log"
echo "gpu_check: kernel tests exit status $tests_rc (124 = timeout)"
fi

# The whole engine step on the GPU (auto backend = the Pallas kernel): the cache must stay in
# place. The Pallas path bitcasts the uint8 buffers to typed views before the pallas_call; if
# XLA:GPU materialises that bitcast, temp memory grows with the cache and this test fails.
mem_rc=0
if want memory; then
timeout --kill-after=10 90 python -m pytest tests/engine/test_step_memory.py -q -p no:cacheprovider \
  > "$OUT_DIR/gpu_step_memory.log" 2>&1 || mem_rc=$?
tail -n 15 "$OUT_DIR/gpu_step_memory.log"
echo "gpu_check: step-memory test exit status $mem_rc (124 = timeout)"
fi

bench_rc=0
if want bench; then
timeout --kill-after=10 200 python benchmarks/_kernel_bench_gpu.py "$OUT_DIR" --budget-s 150 \
  > "$OUT_DIR/gpu_bench.log" 2>&1 || bench_rc=$?
tail -n 40 "$OUT_DIR/gpu_bench.log"
echo "gpu_check: benchmark exit status $bench_rc (124 = timeout)"
fi

async_rc=0
if want async; then
timeout --kill-after=10 110 python benchmarks/async_ab.py --requests 32 --max-tokens 32 --rounds 4 \
  --json "$OUT_DIR/async_ab_gpu.json" \
  > "$OUT_DIR/gpu_async_ab.log" 2>&1 || async_rc=$?
tail -n 12 "$OUT_DIR/gpu_async_ab.log"
echo "gpu_check: async A/B exit status $async_rc (124 = timeout)"
fi

if [[ $tests_rc -ne 0 || $mem_rc -ne 0 || $bench_rc -ne 0 || $async_rc -ne 0 ]]; then
  exit 1
fi
