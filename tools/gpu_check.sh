#!/usr/bin/env bash
# The GPU machine in one command: build, the CUDA tests, compute-sanitizer, the benchmark; logs and reports
# go under $OUT (default /tmp/flashop-gpu).
#
#   OUT=/tmp/report bash tools/gpu_check.sh [STAGE ...]      (no stage named: build test sanitize bench)
#   bash tools/gpu_check.sh --help
#
# Stages (run in this order, whatever order they are named in):
#   prebuilt  unpack built modules from .prebuilt/so.tgz.* (pieces written by `pack` from the same tree) instead of
#             building, so a fresh machine skips the build.
#   build     build the extension with all cores ($OUT/build.log; registers, spills and shared memory per kernel
#             from ptxas in $OUT/ptxas.txt).
#   pack      the built modules as $OUT/so.tgz.aa, .ab, ... (15 MiB pieces) for a later `prebuilt`.
#   test      the CUDA tests (pytest -k "$TEST_K", default "cuda or sm90 or hopper or timed"; TEST_TIMEOUT seconds,
#             default 900, stops a hanging run; TEST_PATHS: test files, default tests/; TEST_JOBS: pytest-xdist
#             workers sharing the GPU). $OUT/test_cuda.log.
#   sanitize  compute-sanitizer (SANITIZE_TOOLS, default "memcheck racecheck") over tools/sanitize_cases.py on small
#             shapes; SANITIZE_CONFIGS (fnmatch patterns over config names, the Hopper ones start with "sm90.")
#             narrows it (default: the bf16 mma.sync configs of widths 64, 128, 160 and 256 and every bf16 Hopper
#             config, forward and backward, and the decode kernels); SANITIZE_ARGS adds tools/sanitize_cases.py options
#             (e.g. --few-shapes, for racecheck). $OUT/sanitize_<tool>.log.
#   bench     the benchmark for docs/benchmarks.md: fwd, bwd and fwd+bwd against torch's FLASH_ATTENTION and
#             CUDNN_ATTENTION backends, written to $OUT/docs/ (bench_<device>.json and .png, and benchmarks.md
#             rendered with the other devices' JSON files from docs/). Copy those three files into docs/.
#             BENCH_ARGS adds flashop.bench arguments (e.g. "--modes fwd --headdims 128"). $OUT/bench.log.
#   variants  windows, softcap, ALiBi and sinks against FlexAttention, and the window's cost
#             (flashop.bench --variants --no-sweep; BENCH_ARGS applies) into $OUT/bench_cuda.{md,json}.
#   varlen    a packed batch against torch's varlen_attn and the dense batch at the mean length
#             (flashop.bench --varlen --no-sweep; BENCH_ARGS applies) into $OUT/bench_cuda.{md,json}.
#   decode    one query token over KV caches of 4k..128k tokens, contiguous and paged, against torch's SDPA
#             backends and the copy bandwidth (flashop.bench --decode --no-sweep; BENCH_ARGS applies).
#   quick     a short benchmark (bf16, d64/d128, seqlens 1k/4k/16k, fwd) into $OUT/bench_cuda.{md,json,png};
#             BENCH_ARGS applies here too.
#   compare   every candidate config timed per shape, relative to the fastest (flashop.tune --dry-run, no cache
#             written); COMPARE_ARGS narrows it, e.g. "--headdims 128 --directions backward". $OUT/compare.log.
#   composition  what a training step's call costs beyond its forward and backward timed apart
#             (tools/probes/kernel_breakdown.py --composition, causal and not; COMPOSITION_ARGS, default "--seqlens 2048
#             16384"), then the SM clock and power of each mode (tools/probes/power_probe.py --mode fwd / bwd /
#             fwd+bwd at POWER_ARGS, default "--seqlen 2048 --causal --seconds 3 --gemm 0"). $OUT/composition.log.
#   policy    tune into a scratch cache, then the policy's picks against the best config per shape
#             (TUNE_ARGS: flashop.tune arguments). $OUT/policy.md, $OUT/tuned_cache.json.
#   fa2       FlashAttention-2's tests/test_flash_attn.py through tools/fa2_suite (FA2_TEST: the file, default
#             .fa2/test_flash_attn.py; FA2_K: a -k expression, default every test function; FA2_ARGS: more
#             pytest arguments, default deselecting the options flashop lacks). $OUT/fa2.log.
#   profile   Nsight Compute on one kernel launch of tools/probes/profile_case.py (PROFILE_ARGS, PROFILE_KERNEL: a
#             kernel name regex, default fwd_kernel_sm90): the report, its details page and a per-instruction
#             stall listing (tools/probes/ncu_sass_listing.py).
# Offline wheels under .whl/ (e.g. expecttest) are installed first.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -uo/{/^#/{s/^# \{0,1\}//;p}}' "$0"; }
known=" prebuilt build pack test sanitize bench variants varlen decode quick compare composition policy fa2 profile "
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    *) [[ "$known" == *" $arg "* ]] || { echo "unknown stage: $arg (stages:$known)" >&2; exit 2; } ;;
  esac
done

OUT=${OUT:-/tmp/flashop-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=" ${*:-build test sanitize bench} "
has() { [[ "$stages" == *" $1 "* ]]; }
status=0
step() { echo "=== $1 ($(date +%T))"; }

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the in-place build
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv

if has prebuilt; then
  step "prebuilt modules from .prebuilt/"
  cat .prebuilt/so.tgz.* | tar xzf - || { echo "no usable .prebuilt/so.tgz.*"; exit 1; }
  python3 -c "import flashop; print(len(flashop.dispatch.built_configs()), 'configs built')" || exit 1
fi

if has build; then
  step build
  MAX_JOBS=$(nproc) python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  grep -E "Compiling entry|registers|spill" "$OUT/build.log" | sed 's/^ptxas info *: //' > "$OUT/ptxas.txt" || true
  grep -B1 -A2 "bytes stack frame, [1-9]" "$OUT/build.log" | head -20
  python3 -c "import flashop; print('built configs:', flashop.dispatch.built_configs())"
fi

if has pack; then
  step pack
  tar cf - flashop/*.so | gzip -1 | split -b 15m - "$OUT/so.tgz." && ls -l "$OUT"/so.tgz.*
fi

if has test; then
  step test
  timeout -s INT -k 30 "${TEST_TIMEOUT:-900}" python3 -m pytest -q -rfEs ${TEST_JOBS:+-n $TEST_JOBS} ${TEST_PATHS:-tests} -k "${TEST_K:-cuda or sm90 or hopper or timed}" 2>&1 \
    | tee "$OUT/test_cuda.log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has sanitize; then
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    step "compute-sanitizer $tool"
    compute-sanitizer --tool $tool --error-exitcode 3 python3 tools/sanitize_cases.py ${SANITIZE_ARGS:-} ${SANITIZE_CONFIGS:-"bf16.d64.*" "bf16.d128.*" "bf16.d160.*" "bf16.d256.*" "sm90.bf16.*" "sm90.bwd.bf16.*" decode} > "$OUT/sanitize_$tool.log" 2>&1
    rc=$?
    tail -4 "$OUT/sanitize_$tool.log"
    [ $rc -eq 0 ] || { echo "sanitizer $tool failed (rc=$rc)"; status=1; }
  done
fi

if has bench; then
  step bench
  mkdir -p "$OUT/docs"
  cp docs/bench_*.json "$OUT/docs/" 2>/dev/null  # the other devices' results, so benchmarks.md keeps their sections
  python3 -m flashop.bench --device cuda --modes fwd bwd fwd+bwd --write-docs "$OUT/docs" ${BENCH_ARGS:-} \
    > "$OUT/bench.log" 2>&1 || status=1
  grep -v "it/s\]" "$OUT/bench.log" | tail -40
  ls -l "$OUT/docs"
fi
if has variants; then
  step "variants vs FlexAttention"
  python3 -m flashop.bench --device cuda --variants --no-sweep --out-dir "$OUT" ${BENCH_ARGS:-} 2>&1 \
    | grep -v "it/s\]" | tail -20
fi
if has varlen; then
  step "packed batch vs varlen_attn"
  python3 -m flashop.bench --device cuda --varlen --no-sweep --out-dir "$OUT" ${BENCH_ARGS:-} 2>&1 \
    | grep -v "it/s\]" | tail -12
fi
if has decode; then
  step "decode vs SDPA and the copy bandwidth"
  python3 -m flashop.bench --device cuda --decode --no-sweep --out-dir "$OUT" ${BENCH_ARGS:-} 2>&1 \
    | grep -v "it/s\]" | tail -16
fi
if has quick; then
  step "quick bench"
  python3 -m flashop.bench --device cuda --out-dir "$OUT" --dtypes bf16 --headdims 64 128 --seqlens 1024 4096 16384 \
    ${BENCH_ARGS:-} 2>&1 | grep -v "it/s\]" | tail -30
fi
if has compare; then
  step "compare configs"
  python3 -m flashop.tune --dry-run ${COMPARE_ARGS:---dtypes bf16 --headdims 64 128 --seqlens 1024 4096 16384} 2>&1 \
    | grep -v "it/s\]" | tee "$OUT/compare.log" | cut -c1-400
fi
if has composition; then
  step "composition: fwd+bwd against fwd + bwd, clocks and power per mode"
  for causal in "" "--causal"; do
    python3 tools/probes/kernel_breakdown.py --composition ${COMPOSITION_ARGS:---seqlens 2048 16384} $causal 2>&1 \
      | grep -v "Warn\|warn" | tee -a "$OUT/composition.log"
  done
  for mode in fwd bwd fwd+bwd; do
    python3 tools/probes/power_probe.py --mode "$mode" ${POWER_ARGS:---seqlen 2048 --causal --seconds 3 --gemm 0} 2>&1 \
      | tee -a "$OUT/composition.log" | tail -5
  done
fi
if has policy; then
  step "policy vs best (tunes into a scratch cache)"
  FLASHOP_CACHE_DIR="$OUT/cache" python3 -m flashop.tune --report "$OUT/policy.md" ${TUNE_ARGS:-} 2>&1 | grep -v "it/s\]" \
    > "$OUT/policy.log"; tail -4 "$OUT/policy.log"
  cp "$OUT/cache/tuned_v1.json" "$OUT/tuned_cache.json" 2>/dev/null; rm -rf "$OUT/cache"
fi
if has fa2; then
  step "FlashAttention-2's tests"
  timeout -s INT -k 30 "${TEST_TIMEOUT:-900}" bash tools/fa2_suite/run.sh "${FA2_TEST:-.fa2/test_flash_attn.py}" -q -rf \
    ${FA2_K:+-k "$FA2_K"} ${FA2_ARGS:---fa2-without dropout_p} 2>&1 \
    | grep -v "^SKIPPED" > "$OUT/fa2.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  grep -E "^FAILED" "$OUT/fa2.log" | cut -c1-200 | head -20; tail -1 "$OUT/fa2.log"
fi
if has profile; then
  step "ncu profile"
  ncu --clock-control none --set full --import-source no -k "regex:${PROFILE_KERNEL:-fwd_kernel_sm90}" -s 2 -c 1 \
    -o "$OUT/profile" -f python3 tools/probes/profile_case.py ${PROFILE_ARGS:-} > "$OUT/profile_run.log" 2>&1 || status=1
  tail -3 "$OUT/profile_run.log"
  ncu --import "$OUT/profile.ncu-rep" --page details > "$OUT/profile_details.txt" 2>&1
  ncu --import "$OUT/profile.ncu-rep" --page source --csv --print-source sass > /tmp/profile_sass.csv 2>&1
  python3 tools/probes/ncu_sass_listing.py /tmp/profile_sass.csv > "$OUT/profile_sass.txt" 2>&1 || status=1
  head -14 "$OUT/profile_sass.txt"
  grep -E "Duration|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per" "$OUT/profile_details.txt" | head -12
fi
step "done (status $status)"
exit $status
