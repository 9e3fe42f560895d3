#!/usr/bin/env bash
# Nsight Compute on the serving rule's dequantizing wgmma kernel (issue 26), on a Hopper GPU
# whose profiler reads the hardware counters (the Firecracker machines):
#
#     bash benchmarks/ncu_dqmma.sh "14336 4096 64 gate_up_m64" "4096 4096 64 q_proj_m64" ...
#
# Each argument is "N K M NAME [bf16]": one `profile_wgmma.py` process runs the rule's config
# three times (with `bf16`: bf16 `F.linear`, the yardstick), ncu profiles the third launch of
# the `_dqmma` kernel (or of cuBLAS's GEMM kernel) with every section (`--set full`; its
# default cache control flushes the caches, so the weight comes from HBM) and leaves the clocks
# alone. Under $OUT (default /tmp/ncu_dqmma): NAME.ncu-rep, NAME_details.txt (the sections) and
# NAME_sass.csv (the per-instruction source counters and warp-stall samples), NAME_raw.csv (every
# collected metric, the pipes' utilization among them), which
# `python3 benchmarks/ncu_stalls.py $OUT` summarizes.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ncu_dqmma}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for spec in "$@"; do
  set -- $spec
  kernel=dqmma extra=
  if [ "${5:-}" = bf16 ]; then kernel='nvjet|xmma|gemm' extra=--bf16; fi
  timeout 120 "$NCU" --clock-control none -k "regex:$kernel" --launch-skip 2 --launch-count 1 \
    --set full --import-source no -f -o "$OUT/$4" \
    python3 benchmarks/profile_wgmma.py --n "$1" --k "$2" --m "$3" $extra > "$OUT/$4.log" 2>&1
  echo "ncu $4: rc=$?"
  "$NCU" -i "$OUT/$4.ncu-rep" --page details > "$OUT/$4_details.txt" 2>&1
  "$NCU" -i "$OUT/$4.ncu-rep" --page source --print-source sass --csv > "$OUT/$4_sass.csv" 2>&1
  "$NCU" -i "$OUT/$4.ncu-rep" --page raw --csv > "$OUT/$4_raw.csv" 2>&1
done
