#!/usr/bin/env bash
# The one script that checks mok on a GPU machine: builds (or uses prebuilt binaries), checks
# the SASS for HGMMA and the compiler's register/spill report, runs the GPU tests, the NCCL
# group of this machine's GPUs, the Python binding with PyTorch CUDA tensors, the benchmarks
# (--bench), then compute-sanitizer's memcheck, racecheck and synccheck on small shapes.
# Full logs go to $OUT (default ./device-out); a short table is printed last. It runs from
# the repository root whatever the current directory (--bin and $OUT are taken from there;
# paths among the --bench arguments are read from the repository root).
#
#   scripts/device_check.sh [--bin DIR] [--pack] [--skip-tests] [--skip-sanitizer] [--bench [ARGS...]]
#
# --bin DIR   use prebuilt binaries in DIR (mok, mok_gpu_tests) instead of building; the
#             library python/mok loads is DIR/../lib/libmok.so. (Building here needs
#             GoogleTest's CMake package, which a machine without a package registry may
#             lack: then build elsewhere, sm_90a, and carry the binaries.)
# --pack      leave one combined log ($OUT/device_log.txt: the last 200 kB of each log) plus
#             $OUT/results/ (the device tool brings back at most 8 files), rewritten after
#             every step and on exit or TERM
# --bench ... run bench/run.py with these arguments, none for its default runs (after the
#             tests, before the sanitizers); its records go to $OUT/results/ unless the
#             arguments give --results-dir
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
FINAL_OUT=$OUT
PACK=0
for a in "$@"; do [ "$a" = --pack ] && PACK=1; [ "$a" = --bench ] && break; done
[ $PACK = 1 ] && { mkdir -p "$FINAL_OUT"; OUT=$(mktemp -d); }
mkdir -p "$OUT"
BIN=""
RUN_TESTS=1
RUN_SAN=1
BENCH_ARGS=()
RUN_BENCH=0
GTEST_FILTER=${GTEST_FILTER:-*}
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) BIN=$2; shift 2 ;;
    --skip-tests) RUN_TESTS=0; shift ;;
    --skip-sanitizer) RUN_SAN=0; shift ;;
    --pack) shift ;;
    --bench) shift; RUN_BENCH=1; BENCH_ARGS=("$@"); break ;;
    *) echo "device_check: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$BIN" ] && BIN=$(realpath -m "$BIN")
OUT=$(realpath -m "$OUT"); FINAL_OUT=$(realpath -m "$FINAL_OUT")
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
summary=()
# --pack: the summary and every log in one file (also when a step ends the script early).
write_pack() {
  [ $PACK = 1 ] || return 0
  {
    printf '%s\n' "${summary[@]}"
    for f in gpu.txt cmake.log build.log ptxas.txt gpu_checks.txt gpu_tests.log gpu_tests_store_warp_off.log binding.log group.log \
      group_tests.log bench_tests.log bench.log sanitizer_memcheck.log sanitizer_racecheck.log sanitizer_group.log \
      sanitizer_group_synccheck.log; do
      [ -f "$OUT/$f" ] && { echo; echo "######## $f"; tail -c 200000 "$OUT/$f"; }
    done
  } > "$FINAL_OUT/device_log.txt"
}
# The pack is rewritten after every step (note) and on the way out, so that a run the device
# tool stops at its time limit still brings back what it did.
note() { summary+=("$1"); echo "== $1"; write_pack; }
trap write_pack EXIT
trap 'write_pack; exit 143' TERM INT
FAILED=0  # any failing step makes the script exit 1 (after every step has run)

# (An earlier run's logs in the same $OUT would be packed, or shown, as this run's.)
for f in gpu.txt cmake.log build.log ptxas.txt gpu_checks.txt gpu_tests.log gpu_tests_store_warp_off.log binding.log \
  group.log group_tests.log bench_tests.log bench.log sanitizer_memcheck.log sanitizer_racecheck.log \
  sanitizer_group.log sanitizer_group_synccheck.log; do
  rm -f "$OUT/$f"
done
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
note "gpu: $(tail -1 "$OUT/gpu.txt")"

if [ -z "$BIN" ]; then
  start=$(date +%s)
  # (The GPU build needs nvcc: found on PATH or in the toolkit's usual place, else an error.)
  command -v nvcc > /dev/null || export PATH=$PATH:/usr/local/cuda/bin
  if cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_REQUIRE_CUDA=ON > "$OUT/cmake.log" 2>&1 &&
     ninja -C build > "$OUT/build.log" 2>&1; then
    note "build: ok in $(( $(date +%s) - start )) s"
  else
    note "build: FAILED (see cmake.log, build.log)"
    if [ -s "$OUT/build.log" ]; then tail -30 "$OUT/build.log"; else tail -30 "$OUT/cmake.log"; fi
    write_pack; printf '%s\n' "${summary[@]}"; exit 1
  fi
  BIN=build/bin
  grep -E "registers|spill" "$OUT/build.log" > "$OUT/ptxas.txt" || true
fi

# wgmmas present, no spills, the producer's, store warp's and gather warps' code inside the setmaxnreg budget
# (the same check CI runs through scripts/test.sh).
sass_rc=0; sass=$(scripts/check_sass.sh "$BIN" "$OUT") || sass_rc=$?
note "$sass"
[ $sass_rc = 0 ] || FAILED=1

if [ $RUN_TESTS = 1 ]; then
  start=$(date +%s)
  [ "$GTEST_FILTER" = '*' ] || note "gpu tests: ONLY those matching GTEST_FILTER=$GTEST_FILTER (not a full check)"
  timeout 240 "$BIN/mok_gpu_tests" --gtest_filter="$GTEST_FILTER" --gtest_output=xml:"$OUT/gpu_tests.xml" > "$OUT/gpu_tests.log" 2>&1
  rc=$?
  [ $rc = 0 ] || FAILED=1
  grep -E "^\[seed\]|^\[check\]|^\[graph\]|^\[slice\]" "$OUT/gpu_tests.log" > "$OUT/gpu_checks.txt" || true
  # (Fresh inputs every run: the seed they came from, to repeat them with MOK_TEST_SEED.)
  test_seed=$(grep -m1 -oE 'MOK_TEST_SEED=[0-9]+' "$OUT/gpu_tests.log")
  note "gpu tests: rc=$rc, $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]' "$OUT/gpu_tests.log" | tr '\n' ' ') in $(( $(date +%s) - start )) s, inputs of ${test_seed:-an unknown seed}"
  grep -E "^\[  FAILED  \]" "$OUT/gpu_tests.log" | head -20
  # A skip is a failure here (no GPU seen, say), but for tests that need what one machine may
  # lack: a second GPU (GpuDevices) and NCCL (GpuGroup, GpuGroupDeathTest: the group section runs
  # and requires them).
  skipped=$(grep -E '^\[  SKIPPED \] [A-Za-z]' "$OUT/gpu_tests.log" | sed -E 's/^\[  SKIPPED \] ([^ ]+).*/\1/' |
    sort -u)
  must_run=$(grep -vE '^(GpuDevices|GpuGroup|GpuGroupDeathTest)\.' <<< "$skipped" | tr '\n' ' ')
  if [ -n "${must_run// /}" ]; then
    note "gpu tests: FAILED: skipped here, where they must run: $must_run"
    FAILED=1
  fi
  allowed=$(grep -E '^GpuDevices\.' <<< "$skipped" | tr '\n' ' ')
  [ -z "${allowed// /}" ] || note "gpu tests: skipped for want of a second GPU: $allowed"
  if [ $rc != 0 ] && [ -z "${MOK_STORE_WARP:-}" ]; then
    # Diagnosis: do the failures follow the store warp (the default) or not?
    timeout 240 env MOK_STORE_WARP=0 ${test_seed:+"$test_seed"} "$BIN/mok_gpu_tests" --gtest_filter="$GTEST_FILTER" \
      > "$OUT/gpu_tests_store_warp_off.log" 2>&1
    note "gpu tests with MOK_STORE_WARP=0 (diagnosis): rc=$?, $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]' \
      "$OUT/gpu_tests_store_warp_off.log" | tr '\n' ' ')"
  fi
fi

# The NCCL provider (EpMode::distributed) on every GPU of this machine, one process each:
# the group's y bitwise equal to virtual ranks' on the same batch, then mok bench twice into
# one work directory (the second run, with --no-peer-inputs, must clear the first's files
# and write mok.json alone). NCCL's search path and the GPU count: scripts/group_env.sh.
# What gtest prints when every test of `filter` (tests/gpu) ran and passed: the group section
# (GpuGroup* : GpuGroup and GpuGroupDeathTest) and synccheck (GpuGroup.*: no death test, whose
# child would run under the sanitizer too) require it. The count comes from the binary's own
# list, so a test added there is required here too (none listed: nothing can match).
all_passed() {
  local n
  n=$("$BIN/mok_gpu_tests" --gtest_list_tests --gtest_filter="$1" 2> /dev/null | grep -c '^  ')
  [ "${n:-0}" -gt 0 ] || n=none
  echo "^\[  PASSED  \] $n tests\?\."
}
GROUP_TESTS_PASSED=$(all_passed 'GpuGroup*')
GROUP_SYNCCHECK_PASSED=$(all_passed 'GpuGroup.*')
if [ $RUN_TESTS = 1 ]; then
  source scripts/group_env.sh  # (from the repository root, where the script runs)
  gpus=$group_gpus
  group_dir=$(mktemp -d)
  start=$(date +%s)
  grc=0
  {
    echo "MOK_NCCL_LIBRARY=${MOK_NCCL_LIBRARY:-(unset)} LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-} gpus=$gpus"
    timeout 180 "$BIN/mok" launch -n "$gpus" -- "$BIN/mok" run --backend cuda --ep-mode distributed --shape medium \
      --ep "$gpus" --iters 3 --warmup 1 --save "$group_dir/group" &&
      timeout 120 "$BIN/mok" run --backend cuda --shape medium --ep "$gpus" --iters 1 --warmup 0 \
        --expect "$group_dir/group" &&
      timeout 180 "$BIN/mok" launch -n "$gpus" -- "$BIN/mok" bench --ep-mode distributed --shape medium --ep "$gpus" \
        --warmup 5 --iters 5 --work-dir "$group_dir/bench" &&
      timeout 180 "$BIN/mok" launch -n "$gpus" -- "$BIN/mok" bench --ep-mode distributed --shape medium --ep "$gpus" \
        --warmup 5 --iters 5 --no-peer-inputs --work-dir "$group_dir/bench"
  } > "$OUT/group.log" 2>&1 || grc=$?
  # Every rank of the second bench found the first one's files and removed them.
  [ $grc = 0 ] && [ "$(grep -c 'removed .* files an earlier run left in .*/rank[0-9]*$' "$OUT/group.log")" != "$gpus" ] && grc=8
  # ... and, with --no-peer-inputs, wrote its mok.json (saying so) and no input for a peer
  # (the reference-row exchange's files stay: the check needs them).
  if [ $grc = 0 ]; then
    peer_inputs='^(x_local|router_weights|y_ref|top_experts|slots_ref|w_(gate|up|down)|shared[0-9]+_w_(gate|up|down))\.npy$'
    for r in $(seq 0 $((gpus - 1))); do
      rank_dir="$group_dir/bench/rank$r"
      echo "rank$r after --no-peer-inputs: $(ls "$rank_dir" | tr '\n' ' ')" >> "$OUT/group.log"
      if ls "$rank_dir" | grep -qE "$peer_inputs" || ! grep -q '"peer_inputs": false' "$rank_dir/mok.json"; then
        grc=11
      fi
    done
    [ $grc = 0 ] && echo "check PASS: --no-peer-inputs wrote mok.json and no peer input on every rank" >> "$OUT/group.log"
  fi
  # A rank whose peer never starts stops within its start-up limit: exit status 4, naming
  # the wait (rank 0 alone: rank 1's arrival; rank 1 alone: rank 0's id), and leaving no id
  # or mark behind.
  for alone in 0 1; do
    [ $grc = 0 ] || break
    want='rank 0 waited 5000 ms for the other ranks to arrive; not arrived: rank 1 '
    [ $alone = 1 ] && want='rank 0.s NCCL id'
    alone_dir=$(mktemp -d)
    alone_start=$(date +%s)
    MOK_RANK=$alone MOK_WORLD_SIZE=2 MOK_LOCAL_RANK=0 MOK_LAUNCH_DIR=$alone_dir MOK_GROUP_START_TIMEOUT_MS=5000 \
      timeout 60 "$BIN/mok" run --backend cuda --ep-mode distributed --shape medium --ep 2 --iters 1 --warmup 0 \
      > "$alone_dir/log" 2>&1
    arc=$?
    alone_s=$(( $(date +%s) - alone_start ))
    { echo "== rank $alone of 2 alone: rc=$arc in $alone_s s"; cat "$alone_dir/log"; } >> "$OUT/group.log"
    if [ $arc != 4 ] || [ $alone_s -gt 30 ] || ! grep -q "$want" "$alone_dir/log" ||
      ls "$alone_dir" | grep -q nccl_unique_id; then
      grc=9
    else
      echo "check PASS: rank $alone of 2 alone stopped with status 4 in $alone_s s" >> "$OUT/group.log"
    fi
    rm -rf "$alone_dir"
  done
  # The library's own group tests (tests/gpu: GpuGroup* = GpuGroup and GpuGroupDeathTest, a
  # group of this one process): a forward that throws, or abandon_group, aborts the group and
  # later calls say why; a device error leaves it usable; forwards queued or held behind an
  # abort do not fault. Elsewhere they skip without NCCL; here they must run.
  if [ $grc = 0 ]; then
    timeout 240 "$BIN/mok_gpu_tests" --gtest_filter='GpuGroup*' > "$OUT/group_tests.log" 2>&1 || grc=10
    # (All of them ran and passed: not skipped, and not a filter that matched nothing.)
    [ $grc = 0 ] && ! grep -q "$GROUP_TESTS_PASSED" "$OUT/group_tests.log" && grc=10
    cat "$OUT/group_tests.log" >> "$OUT/group.log"
    [ $grc = 0 ] && echo "check PASS: GpuGroup tests $(grep -E '^\[  PASSED  \]' "$OUT/group_tests.log")" >> "$OUT/group.log"
  fi
  [ $grc = 0 ] || FAILED=1
  note "nccl group of $gpus GPU(s): rc=$grc, $(grep -cE 'check PASS|bitwise' "$OUT/group.log") passing checks in $(( $(date +%s) - start )) s"
  [ $grc = 0 ] || tail -20 "$OUT/group.log"
  rm -rf "$group_dir"
fi

# python/mok, the binding (libmok.so's C interface), with PyTorch CUDA tensors: the cuda
# backend against the CPU backend, run to run, under torch.cuda.graph replay, and as an NCCL
# group of this process (group_env.sh's search path, sourced above). Here nothing may skip.
if [ $RUN_TESTS = 1 ]; then
  start=$(date +%s)
  MOK_LIBRARY="$BIN/../lib/libmok.so" timeout 300 python3 -m unittest discover -s python/tests -v \
    > "$OUT/binding.log" 2>&1
  brc=$?
  [ $brc = 0 ] && grep -q "skipped" "$OUT/binding.log" && brc=11
  [ $brc = 0 ] || FAILED=1
  note "python binding (torch CUDA): rc=$brc, $(grep -E '^Ran|^OK|^FAILED' "$OUT/binding.log" | tr '\n' ' ')in $(( $(date +%s) - start )) s"
  [ $brc = 0 ] || tail -30 "$OUT/binding.log"
fi

# The benchmark suite's own tests with PyTorch present (CI has none): the peers' pipelines on
# torch's CPU backend against the work directory's references, among the rest.
if [ $RUN_TESTS = 1 ]; then
  timeout 300 python3 -m unittest discover -s bench/tests -v > "$OUT/bench_tests.log" 2>&1
  trc=$?
  [ $trc = 0 ] || FAILED=1
  note "bench/tests (with torch): rc=$trc, $(grep -E '^Ran|^OK|^FAILED' "$OUT/bench_tests.log" | tr '\n' ' ')"
  [ $trc = 0 ] || tail -30 "$OUT/bench_tests.log"
fi

if [ $RUN_BENCH = 1 ]; then
  # (The records where the device tool brings them back, unless the arguments say where.)
  results=(--results-dir "$FINAL_OUT/results")
  for a in "${BENCH_ARGS[@]}"; do case "$a" in --results-dir|--results-dir=*) results=() ;; esac; done
  PYTHONUNBUFFERED=1 timeout "${BENCH_TIMEOUT:-400}" python3 bench/run.py --mok-bin "$(printf %q "$BIN/mok")" \
    "${results[@]}" "${BENCH_ARGS[@]}" 2>&1 | tee "$OUT/bench.log"
  brc=${PIPESTATUS[0]}
  [ $brc = 0 ] || FAILED=1
  note "bench: rc=$brc"
fi

if [ $RUN_SAN = 1 ] && ! command -v compute-sanitizer > /dev/null; then
  if [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
    export PATH=$PATH:/usr/local/cuda/bin
  else
    note "compute-sanitizer: FAILED: not found (PATH, /usr/local/cuda/bin); --skip-sanitizer to go without"
    FAILED=1
  fi
fi
if [ $RUN_SAN = 1 ] && command -v compute-sanitizer > /dev/null; then
  # The default launch on virtual ranks (checked against the reference), then the paths it
  # does not take: one rank's gather mode (its rows copied from x, EP = 1) with a ring that
  # wraps, task pairs (2-CTA clusters, multicast) with a ring that wraps, and a rank slice
  # (its own schedule and slots). Each log is appended to its tool's.
  san_runs=("--shape tiny --check"
            "--shape small --ep 1 --minibatch 128 --macrobatch 256 --check"
            "--shape small --pairs --minibatch 128 --macrobatch 128 --check"
            "--shape small --ep-mode slice")
  for tool in ${SANITIZERS:-memcheck racecheck}; do
    : > "$OUT/sanitizer_$tool.log"
    for run in "${san_runs[@]}"; do
      run_log=$(mktemp)  # (this run's own: its summary and first reports, then appended)
      # shellcheck disable=SC2086  # (each run's words, split)
      timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 "$BIN/mok" run --backend cuda $run \
        --pass forward --iters 1 --warmup 0 > "$run_log" 2>&1
      src=$?
      [ $src = 0 ] || FAILED=1
      summary_line=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$run_log" | tail -1)
      note "compute-sanitizer $tool, $run: rc=$src ${summary_line:-no summary (cut off?)}"
      # The first reports, where the table is read (the full log is in the pack).
      [ $src = 0 ] || grep -v '^mok\|^  ' "$run_log" | head -40
      { echo "== compute-sanitizer --tool $tool: mok run $run (rc=$src)"; cat "$run_log"; } >> "$OUT/sanitizer_$tool.log"
      rm -f "$run_log"
    done
  done
  # memcheck over the NCCL provider too (a group of one GPU: the windows' LSA pointers, the
  # all-gather and barrier kernels). NCCL's own probing makes CUDA API calls that fail by
  # design (kernel images for other GPUs, fabric handles), so API errors are not reported.
  if [ $RUN_TESTS = 1 ]; then
    timeout 240 compute-sanitizer --tool memcheck --report-api-errors no --target-processes all --error-exitcode 9 \
      "$BIN/mok" launch -n 1 -- "$BIN/mok" run --backend cuda --ep-mode distributed --shape tiny --ep 1 \
      --iters 1 --warmup 0 > "$OUT/sanitizer_group.log" 2>&1
    src=$?
    [ $src = 0 ] || FAILED=1
    note "compute-sanitizer memcheck, NCCL group of 1: rc=$src $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_group.log" | head -1)"
    [ $src = 0 ] || grep -v '^mok\|^  ' "$OUT/sanitizer_group.log" | head -40
    # synccheck over the library's group tests: the epilogue's warp vote over the gathered
    # error codes (a partial warp in GpuGroup.ADeviceError...).
    timeout 240 compute-sanitizer --tool synccheck --report-api-errors no --error-exitcode 9 \
      "$BIN/mok_gpu_tests" --gtest_filter='GpuGroup.*' > "$OUT/sanitizer_group_synccheck.log" 2>&1
    src=$?
    grep -q "$GROUP_SYNCCHECK_PASSED" "$OUT/sanitizer_group_synccheck.log" || src=10
    [ $src = 0 ] || FAILED=1
    note "compute-sanitizer synccheck, GpuGroup tests: rc=$src $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_group_synccheck.log" | head -1)"
    [ $src = 0 ] || grep -v '^mok\|^  ' "$OUT/sanitizer_group_synccheck.log" | head -40
  fi
fi

write_pack
echo
echo "==== summary ===="
printf '%s\n' "${summary[@]}"
exit $FAILED
