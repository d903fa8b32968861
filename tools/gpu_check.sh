#!/usr/bin/env bash
# The GPU machine in one command: build with all cores, CUDA tests, compute-sanitizer on small
# shapes, the CUDA benchmark; logs, the report (markdown + PNG) and the build report under $OUT.
#
#   tools/gpu_check.sh [prebuilt] [build] [sm90build] [pack] [test] [sanitize] [bench] [quick] [compare] [ab] [abbuild] [envab] [waves] [power] [wgmma] [policy] [profile]
#   (none named: build test sanitize bench)
#
# pack: the built extension modules as $OUT/so.tgz.aa, .ab, ... (15 MiB pieces, under the device tool's
#   size limit per file); prebuilt: unpack such pieces from .prebuilt/ (carried) instead of building, so a
#   later run on a fresh machine skips the build (the modules must come from the same tree).
# sm90build: rebuild only the Hopper module (FLASHOP_SM90_ONLY=1) over the modules in place, e.g. after prebuilt
#   when only csrc/cuda/sm90 or its glue changed since the pieces were packed.
# compare: every candidate config timed per shape, relative to the fastest (no cache written);
#   COMPARE_ARGS narrows it (flashop.tune arguments), e.g. "--headdims 128 --directions backward".
# abbuild: a kernel experiment across two builds of the Hopper module: the current build (A) against a
#   rebuild with FLASHOP_SM90_NVCC_FLAGS=$ABB_FLAGS (B); ABB_TEST (pytest -k expression) tests B first;
#   then the benchmark (AB_ARGS) runs ABB_ROUNDS times per side, sides alternating; ABB_POWER=1 adds the
#   power probe (POWER_ARGS) once per side. ABB_FLAGS_C adds a third side C, built, tested and timed the
#   same way. The last side built stays installed.
# envab: the benchmark (AB_ARGS) with and without the environment setting ENVAB (e.g.
#   "FLASHOP_SM90_SPLIT_LAST_WAVE=0"), sides alternating, ABB_ROUNDS times each: A default, B with it.
# waves: how many CTAs and clusters run at once (tools/cluster_occupancy.cu), then tools/wave_probe.py
#   (WAVE_ARGS: config, --seqlen, --heads) with the split last wave on and off.
# power: SM clock and board power while flashop and cuDNN each run alone (tools/power_probe.py, POWER_ARGS).
# wgmma: the share of the tensor pipe's peak per clock that bare wgmma streams reach, by shape and in the d128
#   forward's GEMM mix without a softmax (tools/wgmma_rate.cu).
# policy: tune, then measure the policy's picks against the best config per shape.
# ab: the benchmark (flashop.bench, its own runner and peers) once per config named in AB_CONFIGS, then the
#   tuner's timing of the same shapes, so the two harnesses can be compared on one machine; AB_ARGS
#   gives the benchmark's shape arguments, e.g. "--dtypes bf16 --headdims 64 --seqlens 1024 --causal True".
# profile: Nsight Compute on one kernel launch of tools/profile_case.py (PROFILE_ARGS, PROFILE_KERNEL);
#   the report, its details page, and a per-instruction stall listing (tools/ncu_sass_listing.py).
# TEST_K narrows the test stage (pytest -k expression); AB_TUNER=0 skips the tuner half of ab. TEST_TIMEOUT (seconds,
# default 900) stops a hanging test run of the test and abbuild stages.
# SANITIZE_CONFIGS (fnmatch patterns over config names; the Hopper ones start with "sm90.") and SANITIZE_TOOLS narrow
# the sanitizer stage (default: every bf16 config, mma.sync and Hopper).
# quick: a short benchmark (seqlens 1k/4k/16k, d64/d128, bf16). Extra arguments for the benchmark
# go in BENCH_ARGS. Offline wheels under .whl/ (e.g. expecttest) are installed first.
set -uo pipefail
cd "$(dirname "$0")/.."
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
  # Registers, spills and shared memory per kernel, from ptxas.
  grep -E "Compiling entry|registers|spill" "$OUT/build.log" | sed 's/^ptxas info *: //' > "$OUT/ptxas.txt" || true
  grep -B1 -A2 "bytes stack frame, [1-9]" "$OUT/build.log" | head -20
  python3 -c "import flashop; print('built configs:', flashop.dispatch.built_configs())"
fi

if has sm90build; then
  step "build (Hopper module only)"
  FLASHOP_SM90_ONLY=1 MAX_JOBS=$(nproc) python3 setup.py build_ext --inplace > "$OUT/build_sm90.log" 2>&1 \
    || { tail -50 "$OUT/build_sm90.log"; exit 1; }
  grep -E "Compiling entry|registers|spill" "$OUT/build_sm90.log" | sed 's/^ptxas info *: //' > "$OUT/ptxas.txt" || true
  python3 -c "import flashop; print(len(flashop.dispatch.built_configs()), 'configs built')" || exit 1
fi

if has pack; then
  step pack
  tar cf - flashop/*.so | gzip -1 | split -b 15m - "$OUT/so.tgz." && ls -l "$OUT"/so.tgz.*
fi

if has test; then
  step test
  timeout "${TEST_TIMEOUT:-900}" python3 -m pytest -q -rfEs tests -k "${TEST_K:-cuda or sm90 or hopper or timed}" 2>&1 \
    | tee "$OUT/test_cuda.log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has sanitize; then
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    step "compute-sanitizer $tool"
    compute-sanitizer --tool $tool --error-exitcode 3 python3 tools/sanitize_cases.py ${SANITIZE_CONFIGS:-"bf16.d64.*" "bf16.d128.*" "bf16.d256.*" "sm90.bf16.*"} > "$OUT/sanitize_$tool.log" 2>&1
    rc=$?
    tail -4 "$OUT/sanitize_$tool.log"
    [ $rc -eq 0 ] || { echo "sanitizer $tool failed (rc=$rc)"; status=1; }
  done
fi

if has bench; then
  step bench
  python3 -m flashop.bench --device cuda --out-dir "$OUT" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1 || status=1
  grep -v "it/s\]" "$OUT/bench.log" | tail -40
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
if has ab; then
  step "a/b: the benchmark per forced config, then the tuner on the same shapes"
  for config in ${AB_CONFIGS:?AB_CONFIGS names the configs to compare}; do
    python3 -m flashop.bench --device cuda --modes fwd ${AB_ARGS:-} --config "$config" 2>&1 | grep "^| [bf]" \
      | sed "s/^/$config /" | tee -a "$OUT/ab.log"
  done
  if [ "${AB_TUNER:-1}" != 0 ]; then
    python3 -m flashop.tune --dry-run $(echo "${AB_ARGS:-}" | sed 's/--modes [a-z+]*//') 2>&1 | tr '\r' '\n' \
      | grep "picked" | tee -a "$OUT/ab.log" | cut -c1-400
  fi
fi
if has abbuild; then
  # Side B: ABB_FLAGS; side C (optional): ABB_FLAGS_C. Each side is built over the current module, tested
  # (ABB_TEST) and then timed against A in alternating processes.
  step "a/b across builds: B = FLASHOP_SM90_NVCC_FLAGS='${ABB_FLAGS:?ABB_FLAGS names the experiment flags}'${ABB_FLAGS_C:+, C = '$ABB_FLAGS_C'}"
  so=$(ls flashop/_C_sm90*.so) && mkdir -p /tmp/abb && cp "$so" /tmp/abb/A.so
  sides="A B"
  for side in B C; do
    if [ "$side" = B ]; then flags=$ABB_FLAGS; else flags=${ABB_FLAGS_C:-}; [ -n "$flags" ] || continue; sides="A B C"; fi
    FLASHOP_SM90_ONLY=1 FLASHOP_SM90_NVCC_FLAGS="$flags" MAX_JOBS=$(nproc) python3 setup.py build_ext --inplace \
      > "$OUT/build_$side.log" 2>&1 \
      || { tail -50 "$OUT/build_$side.log"; exit 1; }
    grep -E "Compiling entry|registers|spill" "$OUT/build_$side.log" | sed 's/^ptxas info *: //' > "$OUT/ptxas_$side.txt" || true
    cp "$so" "/tmp/abb/$side.so"
    if [ -n "${ABB_TEST:-}" ]; then  # a failing (or hanging: TEST_TIMEOUT seconds) side is not timed
      timeout "${TEST_TIMEOUT:-900}" python3 -m pytest -q -x tests -k "$ABB_TEST" > "$OUT/test_$side.log" 2>&1
      rc=$?
      tail -3 "$OUT/test_$side.log"
      [ $rc -eq 0 ] || { echo "$side tests failed (rc=$rc)"; exit 1; }
    fi
  done
  for round in $(seq "${ABB_ROUNDS:-2}"); do
    for side in $sides; do
      cp "/tmp/abb/$side.so" "$so"
      python3 -m flashop.bench --device cuda --modes fwd ${AB_ARGS:-} 2>&1 | grep "^| [bf]" \
        | sed "s/^/$side$round /" | tee -a "$OUT/abb.log"
    done
  done
  if [ "${ABB_POWER:-0}" != 0 ]; then  # clock and power of each side under load (tools/power_probe.py, POWER_ARGS)
    for side in $sides; do
      cp "/tmp/abb/$side.so" "$so"
      echo "side $side" >> "$OUT/abb_power.log"
      python3 tools/power_probe.py ${POWER_ARGS:-} 2>&1 | tee -a "$OUT/abb_power.log"
    done
  fi
fi
if has envab; then
  step "a/b by environment: B = ${ENVAB:?ENVAB names the setting of side B}"
  for round in $(seq "${ABB_ROUNDS:-2}"); do
    python3 -m flashop.bench --device cuda --modes fwd ${AB_ARGS:-} 2>&1 | grep "^| [bf]" | sed "s/^/A$round /" \
      | tee -a "$OUT/envab.log"
    env "$ENVAB" python3 -m flashop.bench --device cuda --modes fwd ${AB_ARGS:-} 2>&1 | grep "^| [bf]" \
      | sed "s/^/B$round /" | tee -a "$OUT/envab.log"
  done
fi
if has waves; then
  step "waves: concurrent clusters, time against grid size"
  "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" -arch=sm_90a -o /tmp/cluster_occupancy tools/cluster_occupancy.cu && /tmp/cluster_occupancy | tee "$OUT/waves.log"
  for split in 1 0; do
    echo "split last wave $split" | tee -a "$OUT/waves.log"
    FLASHOP_SM90_SPLIT_LAST_WAVE=$split python3 tools/wave_probe.py \
      ${WAVE_ARGS:-sm90.bf16.d128.br128.bc192.mc.tmao --seqlen 8192 --heads 24} 2>&1 | tee -a "$OUT/waves.log"
  done
fi
if has power; then
  step "power: clock and board power per implementation"
  python3 tools/power_probe.py ${POWER_ARGS:-} 2>&1 | tee "$OUT/power.log"
fi
if has wgmma; then
  step "wgmma: share of the tensor peak per clock"
  "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" -arch=sm_90a -std=c++17 --use_fast_math -Icsrc -o /tmp/wgmma_rate tools/wgmma_rate.cu \
    && /tmp/wgmma_rate | tee "$OUT/wgmma_rate.log" || status=1
fi
if has policy; then
  step "policy vs best (tunes into a scratch cache)"
  FLASHOP_CACHE_DIR="$OUT/cache" python3 -m flashop.tune --report "$OUT/policy.md" ${TUNE_ARGS:-} 2>&1 | grep -v "it/s\]" \
    > "$OUT/policy.log"; tail -4 "$OUT/policy.log"
  cp "$OUT/cache/tuned_v1.json" "$OUT/tuned_cache.json" 2>/dev/null; rm -rf "$OUT/cache"
fi
if has profile; then
  step "ncu profile"
  ncu --clock-control none --set full --import-source no -k "regex:${PROFILE_KERNEL:-fwd_kernel_sm90}" -s 2 -c 1 \
    -o "$OUT/profile" -f python3 tools/profile_case.py ${PROFILE_ARGS:-} > "$OUT/profile_run.log" 2>&1 || status=1
  tail -3 "$OUT/profile_run.log"
  ncu --import "$OUT/profile.ncu-rep" --page details > "$OUT/profile_details.txt" 2>&1
  ncu --import "$OUT/profile.ncu-rep" --page source --csv --print-source sass > /tmp/profile_sass.csv 2>&1
  python3 tools/ncu_sass_listing.py /tmp/profile_sass.csv > "$OUT/profile_sass.txt" 2>&1 || status=1
  head -14 "$OUT/profile_sass.txt"
  grep -E "Duration|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per" "$OUT/profile_details.txt" | head -12
fi
step "done (status $status)"
exit $status
