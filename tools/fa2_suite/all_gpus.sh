#!/usr/bin/env bash
# FlashAttention-2's suite (run.sh) over every GPU of the machine at once: GPU i runs part i/N of the cases
# (fa2_select.py --fa2-part) with WORKERS pytest-xdist workers; the logs go to $OUT/fa2_gpu<i>.log and the summary
# lines are printed at the end. TIMEOUT (seconds) stops the runs with SIGINT, so pytest still prints its summary.
# SLICES=S SLICE=s runs slice s (0 .. S-1) of S disjoint slices of the cases, for a suite too long for one run.
#
#   OUT=/tmp/report WORKERS=12 TIMEOUT=500 bash tools/fa2_suite/all_gpus.sh PATH/TO/test_flash_attn.py [pytest arguments]
set -uo pipefail
test_file=${1:?usage: all_gpus.sh PATH/TO/test_flash_attn.py [pytest arguments]}
shift
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/flashop-gpu}
mkdir -p "$OUT"
gpus=$(nvidia-smi --list-gpus | wc -l)
slices=${SLICES:-1}
slice=${SLICE:-0}
for ((i = 0; i < gpus; i++)); do
  part="$((slice * gpus + i))/$((slices * gpus))"
  CUDA_VISIBLE_DEVICES=$i timeout -s INT -k 30 "${TIMEOUT:-3600}" bash "$here/run.sh" "$test_file" -q -rf -n "${WORKERS:-8}" --fa2-part "$part" "$@" 2>&1 \
    | grep -v "^SKIPPED" > "$OUT/fa2_gpu$i.log" &
done
wait
status=0
for ((i = 0; i < gpus; i++)); do
  grep -E "^FAILED" "$OUT/fa2_gpu$i.log" | cut -c1-200 | head -10
  summary=$(tail -1 "$OUT/fa2_gpu$i.log")
  echo "gpu $i: $summary"
  [[ "$summary" == *passed* && "$summary" != *failed* && "$summary" != *error* ]] || status=1
done
exit $status
