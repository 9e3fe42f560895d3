#!/usr/bin/env bash
# Convert a large checkpoint with a SLURM job array: one task per part, then one finalize step.
#
#   sbatch --array=0-7 examples/slurm-convert-array.sh /models/DeepSeek-V3-MXFP8 /shared/DeepSeek-V3-trtllm
#   sbatch --dependency=afterok:<array job id> --wrap "mxfp8-convert finalize /shared/DeepSeek-V3-trtllm"
#
# Each task converts the input shards j with j % N == SLURM_ARRAY_TASK_ID into the shared
# work folder beside OUT; a task that is preempted or fails can simply be resubmitted (it
# resumes). `finalize` refuses to run until every part has finished with the same options.
# Set DRY_RUN=1 to print the plan only.
#SBATCH --job-name=mxfp8-convert
#SBATCH --cpus-per-task=4
#SBATCH --mem=16G
#SBATCH --time=02:00:00
set -euo pipefail

MODEL=${1:?usage: slurm-convert-array.sh MODEL OUT [BACKEND]}
OUT=${2:?usage: slurm-convert-array.sh MODEL OUT [BACKEND]}
BACKEND=${3:-trtllm}
PARTS=${SLURM_ARRAY_TASK_COUNT:-1}
PART=${SLURM_ARRAY_TASK_ID:-0}

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  exec mxfp8-convert "$MODEL" --backend "$BACKEND" -o "$OUT" --dry-run --json
fi
exec mxfp8-convert "$MODEL" --backend "$BACKEND" -o "$OUT" \
  --num-parts "$PARTS" --part "$PART" --workers "${SLURM_CPUS_PER_TASK:-1}" --max-memory 12GiB --quiet
