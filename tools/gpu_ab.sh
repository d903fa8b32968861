#!/usr/bin/env bash
# A/B of the kernel sources against a git revision, in one call on the GPU machine (which has no git): two builds of
# the same configs, one of this tree and one of this tree with the files that differ from REV as they were at REV,
# compiled in parallel; then the tests of the tree build, and the benchmark of each build in turn, AB_ROUNDS times.
#
#   bash tools/gpu_ab.sh prepare REV      here: .ab/base/ gets REV's version of each tracked file that differs
#                                         (git diff REV; .ab/removed lists the files REV lacks); .ab is git-ignored:
#                                         pass carry [".ab"]
#   OUT=/tmp/report bash tools/gpu_ab.sh run    on the GPU machine; logs in $OUT/ab_*.log
#
# run's settings (environment):
#   AB_KERNELS, AB_BWD_KERNELS  FLASHOP_KERNELS / FLASHOP_BWD_KERNELS of both builds (keep them few: each build
#                               compiles them all; default sm90.bf16.d128.br128.bc128 / sm90.bwd.bf16.d128.br64.bc128)
#   AB_BENCH                    flashop.bench arguments (default: bwd, d128 bf16, seqlens 1k 4k 16k)
#   AB_ROUNDS                   benchmark turns per build, alternating (default 2)
#   AB_TESTS                    pytest arguments run on the tree's build first (default none)
#   AB_SANITIZE                 a compute-sanitizer tool, then tools/sanitize_cases.py arguments, run on the tree's
#                               build after the tests (default none), e.g. "memcheck sm90.bwd.bf16.d128.*"; restricted
#                               builds keep it short ($OUT/ab_sanitize.log)
#   AB_POWER                    tools/probes/power_probe.py arguments, run on each build after the benchmark
#                               (default none): its clock and power, where a change moves energy per step
#   AB_DEVICE                   cuda (default) or cpu (FLASHOP_CUDA=0 builds: checks this script on a CPU machine)
set -uo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  prepare)
    rev=${2:?usage: tools/gpu_ab.sh prepare REV}
    rm -rf .ab && mkdir -p .ab/base && : > .ab/removed
    git diff --name-only "$rev" -- csrc flashop setup.py pyproject.toml tools tests | while read -r f; do
      if git cat-file -e "$rev:$f" 2>/dev/null; then
        mkdir -p ".ab/base/$(dirname "$f")" && git show "$rev:$f" > ".ab/base/$f"
      else
        echo "$f" >> .ab/removed
      fi
    done
    echo "$rev $(git rev-parse --short "$rev")" > .ab/rev
    echo "base = $(cat .ab/rev): $(find .ab/base -type f | wc -l) files back, $(wc -l < .ab/removed) removed"
    ;;
  run)
    OUT=${OUT:-/tmp/flashop-ab}
    mkdir -p "$OUT"
    [ -d .ab/base ] || { echo "no .ab/base: run 'tools/gpu_ab.sh prepare REV' first and carry .ab"; exit 2; }
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
    fi
    device=${AB_DEVICE:-cuda}
    jobs=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
    for v in base tree; do
      rm -rf "/tmp/ab_$v" && mkdir -p "/tmp/ab_$v"
      cp -r csrc flashop tools tests setup.py pyproject.toml MANIFEST.in README.md "/tmp/ab_$v/"
      rm -f /tmp/ab_"$v"/flashop/*.so
    done
    cp -r .ab/base/. /tmp/ab_base/
    while read -r f; do [ -n "$f" ] && rm -f "/tmp/ab_base/$f"; done < .ab/removed
    echo "base: $(cat .ab/rev 2>/dev/null)"
    cuda_env=()  # the build's own choice (CUDA where torch and nvcc have it), or none on AB_DEVICE=cpu
    [ "$device" = cpu ] && cuda_env=(FLASHOP_CUDA=0)
    for v in base tree; do
      (cd "/tmp/ab_$v" && env "${cuda_env[@]}" \
         FLASHOP_KERNELS=${AB_KERNELS:-sm90.bf16.d128.br128.bc128} \
         FLASHOP_BWD_KERNELS=${AB_BWD_KERNELS:-sm90.bwd.bf16.d128.br64.bc128} \
         MAX_JOBS=$jobs python3 setup.py build_ext --inplace > "$OUT/ab_build_$v.log" 2>&1
       echo "built $v: rc $? ($(date +%T))") &
    done
    wait
    status=0
    if [ -n "${AB_TESTS:-}" ]; then
      echo "=== tests on the tree's build ($(date +%T))"
      (cd /tmp/ab_tree && PYTHONPATH="/tmp/site:/tmp/ab_tree" python3 -m pytest -q $AB_TESTS 2>&1 | tail -3) \
        | tee "$OUT/ab_tests.log"
    fi
    if [ -n "${AB_SANITIZE:-}" ]; then
      read -r -a sanitize <<< "$AB_SANITIZE"  # an array: the config patterns are not globbed
      echo "=== compute-sanitizer ${sanitize[0]} on the tree's build ($(date +%T))"
      (cd /tmp/ab_tree && PYTHONPATH="/tmp/site:/tmp/ab_tree" compute-sanitizer --tool "${sanitize[0]}" \
         --error-exitcode 3 python3 tools/sanitize_cases.py "${sanitize[@]:1}" > "$OUT/ab_sanitize.log" 2>&1) \
        || { echo "sanitizer ${sanitize[0]} failed"; status=1; }
      tail -3 "$OUT/ab_sanitize.log"
    fi
    for round in $(seq "${AB_ROUNDS:-2}"); do
      for v in base tree; do
        echo "=== bench $v, round $round ($(date +%T))"
        (cd "/tmp/ab_$v" && PYTHONPATH="/tmp/site:/tmp/ab_$v" python3 -m flashop.bench --device "$device" \
           ${AB_BENCH:---modes bwd --headdims 128 --dtypes bf16 --seqlens 1024 4096 16384} --out-dir "/tmp/ab_out_$v" \
           2>&1 | grep "^| " | tee -a "$OUT/ab_bench_$v.log") || status=1
      done
    done
    if [ -n "${AB_POWER:-}" ]; then
      for v in base tree; do
        echo "=== power $v ($(date +%T))"
        (cd "/tmp/ab_$v" && PYTHONPATH="/tmp/site:/tmp/ab_$v" python3 tools/probes/power_probe.py $AB_POWER 2>&1 \
           | tail -5 | tee -a "$OUT/ab_power_$v.log") || status=1
      done
    fi
    exit $status
    ;;
  *)
    sed -n '2,/^set -uo/{/^#/{s/^# \{0,1\}//;p}}' "$0"
    exit 2
    ;;
esac
