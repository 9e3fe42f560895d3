#!/usr/bin/env bash
# The H200 checks of the runtime/hopper/ package: one device call of at most ~8 minutes, results
# under $OUT. Before the call, place the old package (commit a5719ef) at old_pkg/mxfp8_convert in
# the repository root (untracked), e.g. `git archive a5719ef mxfp8_convert | tar -x -C old_pkg`.
#
#     bash benchmarks/gpu_check.sh
#
# 1. the GPU test suite, `pytest -m gpu tests/runtime` (junit XML kept; about 95 s alone, and more
#    than 270 s when the comparison shares the GPU, so the steps run one after the other);
# 2. the bit comparison with the old tree (benchmarks/compare_bits.py), old side then new side;
# 3. the BENCHMARKS.md rows, `bench_gemm.py gemm --ms $BENCH_MS` (default: the serving batches of
#    issue 26, 32,64,128,256,512,2048,8192), with the time left (JSON saved after each shape, so a
#    run cut short keeps its rows; the GPU is otherwise idle then).
# GPU_CHECK_BUDGET (default 470 s) bounds the whole script: call it with timeout_s=600.
# $OUT gets: gpu_check.log, compare_old.log, compare_bits_old.json, compare_bits.json,
# pytest.xml, bench_gemm.json (six files; the device returns at most eight).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
BUDGET=${GPU_CHECK_BUDGET:-470}  # seconds for the whole script
T0=$SECONDS
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
left() { echo $((BUDGET - (SECONDS - T0))); }
step() { echo "=== [$((SECONDS - T0)) s] $*" | tee -a "$LOG"; }

step "environment"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
    'triton', triton.__version__)"
  git log -1 --format='commit %H %s' 2>/dev/null || true; } >> "$LOG" 2>&1
if [ ! -f old_pkg/mxfp8_convert/runtime/triton_mxfp8.py ]; then
  echo "old_pkg/mxfp8_convert (commit a5719ef) is missing: the bit comparison cannot run" \
    | tee -a "$LOG"
  OLD=0
else
  OLD=1
fi

step "pytest -m gpu tests/runtime"
PYTHONPATH="$PWD" timeout 270 $PY -m pytest -m gpu tests/runtime -q -p no:cacheprovider \
  --junitxml="$OUT/pytest.xml" >> "$LOG" 2>&1
echo "pytest rc=$?" | tee -a "$LOG"

if [ "$OLD" = 1 ]; then
  step "compare_bits: old side"
  ( cd old_pkg && PYTHONPATH="$PWD" timeout 150 $PY ../benchmarks/compare_bits.py . --side old \
      --dump "$OUT/compare_bits_old.json" > "$OUT/compare_old.log" 2>&1 )
  echo "old side rc=$?" | tee -a "$LOG"
  step "compare_bits: new side"
  PYTHONPATH="$PWD" timeout $(( $(left) > 180 ? 90 : $(left) / 2 )) \
    $PY benchmarks/compare_bits.py old_pkg \
    --out "$OUT" >> "$LOG" 2>&1
  echo "compare_bits rc=$?" | tee -a "$LOG"
fi

T=$(( $(left) - 10 ))
if [ "$T" -gt 30 ]; then
  MS=${BENCH_MS:-32,64,128,256,512,2048,8192}
  step "bench_gemm gemm --ms $MS (${T} s)"
  PYTHONPATH="$PWD" timeout "$T" $PY benchmarks/bench_gemm.py gemm --ms "$MS" --out "$OUT" \
    >> "$LOG" 2>&1
  echo "bench rc=$?" | tee -a "$LOG"
else
  echo "no time left for the benchmark" | tee -a "$LOG"
fi
step "done"
