#!/usr/bin/env bash
# The real multi-GPU checks in one command, on a machine with G GPUs (one process per GPU,
# mok launch, the NCCL provider): for every EP size N in 2, 4, 8 with N <= G (1 when G = 1),
#   1. bitwise: a group of N real ranks and N virtual ranks on one GPU give the same y on the
#      same global batch (medium, and Qwen3.5's layer at 512 tokens per rank), and the
#      virtual ranks pass the CPU reference check (--check) on that batch;
#   2. reference: `mok bench --ep-mode distributed` on Qwen3.5 checks every rank's rows and y
#      against the reference (each rank computes its own);
#   3. a killed rank: rank 1 of a long-running group is killed with SIGKILL; the launcher
#      must exit non-zero naming rank 1 within 60 s (N >= 2 only); and rank 1 abandoning
#      its group as its layer's destroy starts: the others' destroys give up on it in time;
#   4. with 2 GPUs or more, a layer on GPU 1 called with GPU 0 current (GpuDevices);
# then, with --bench, bench/run.py --launch G on Qwen3.5 at 2048 tokens per rank against the
# PyTorch + NCCL all-to-all peer (records under $OUT/results).
#
#   scripts/device_multi.sh [--bin DIR] [--bench] [--sizes 2,4,8]
#
# NCCL and multicast: scripts/group_env.sh. Logs under $OUT; a table last;
# exit 1 when any check failed.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
BIN=build/bin
BENCH=0
SIZES=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) BIN=$2; shift 2 ;;
    --bench) BENCH=1; shift ;;
    --sizes) SIZES=$2; shift 2 ;;
    *) echo "device_multi: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -x "$BIN/mok" ] || { echo "device_multi: $BIN/mok is missing (build first, or --bin DIR)" >&2; exit 1; }
source "$(dirname "$0")/group_env.sh"  # multicast off, NCCL's search path, group_gpus
gpus=$group_gpus
if [ "$gpus" -lt 1 ]; then
  echo "device_multi: no GPU visible here (nvidia-smi -L, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset})" >&2
  exit 1
fi
echo "device_multi: $gpus GPU(s) visible"
if [ -z "$SIZES" ]; then
  SIZES=""
  for n in 2 4 8; do [ "$n" -le "$gpus" ] && SIZES="$SIZES${SIZES:+,}$n"; done
  [ -z "$SIZES" ] && SIZES=1
fi
table=()
FAILED=0
row() { table+=("$1"); echo "== $1"; }
# verdict RC COUNT WANT: "ok" when the command succeeded and COUNT = WANT, else "FAILED".
verdict() {
  if [ "$1" = 0 ] && [ "$2" = "$3" ]; then echo ok; else echo FAILED; fi
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for n in ${SIZES//,/ }; do
  if [ "$n" -gt "$gpus" ]; then row "EP=$n: skipped, $gpus GPU(s) here"; continue; fi
  # 1. real vs virtual ranks, bit for bit, and the virtual ranks against the reference.
  for case in "medium" "qwen3.5-397b-a17b --tokens 512"; do
    name=${case%% *}
    log="$OUT/bitwise_${name}_ep$n.log"
    rm -rf "$work/real"
    # shellcheck disable=SC2086
    { timeout 300 "$BIN/mok" launch -n "$n" -- "$BIN/mok" run --backend cuda --ep-mode distributed --shape $case \
        --ep "$n" --iters 3 --warmup 1 --save "$work/real" &&
      timeout 300 "$BIN/mok" run --backend cuda --ep-mode all --shape $case --ep "$n" --iters 1 --warmup 0 \
        --expect "$work/real" --check; } > "$log" 2>&1
    rc=$?
    same=$(grep -c "is bitwise equal to" "$log")
    v=$(verdict $rc "$same" "$n")
    [ "$v" = ok ] || FAILED=1
    row "EP=$n $name: real vs virtual ranks: rc=$rc, $same of $n ranks bitwise equal, reference check $(grep -q 'FAIL' "$log" && echo FAIL || echo passed): $v"
  done
  # 2. the distributed benchmark's own reference check on a MoK shape (no timing claims here;
  #    no peer runs, so no rank writes its inputs: Qwen3.5's expert weights are 12.9 GB a group).
  log="$OUT/bench_check_ep$n.log"
  timeout 400 "$BIN/mok" launch -n "$n" -- "$BIN/mok" bench --ep-mode distributed --shape qwen3.5-397b-a17b \
    --ep "$n" --tokens 512 --warmup 5 --iters 5 --no-peer-inputs --work-dir "$work/bench$n" > "$log" 2>&1
  rc=$?
  pass=$(grep -c "check PASS" "$log")
  v=$(verdict $rc "$pass" "$n")
  [ "$v" = ok ] || FAILED=1
  row "EP=$n qwen3.5 T=512: mok bench reference check: rc=$rc, $pass of $n ranks PASS: $v"
  rm -rf "$work/bench$n"
  # 3. rank 1 killed mid-run: the launcher names it and stops the rest within 60 s.
  if [ "$n" -ge 2 ]; then
    log="$OUT/killed_ep$n.log"
    start=$(date +%s)
    timeout 240 "$BIN/mok" launch -n "$n" -- sh -c \
      "if [ \"\$MOK_RANK\" = 1 ]; then (sleep 20; kill -9 \$\$) & fi; exec \"$BIN/mok\" run --backend cuda \
       --ep-mode distributed --shape qwen3.5-397b-a17b --ep $n --tokens 512 --iters 1000000 --warmup 0" > "$log" 2>&1
    rc=$?
    took=$(( $(date +%s) - start - 20 ))
    named=$(grep -c "rank 1 was killed by signal 9" "$log")
    ok=1
    [ $rc != 0 ] && [ "$named" -ge 1 ] && [ $took -le 60 ] || { ok=0; FAILED=1; }
    row "EP=$n killed rank 1: launcher rc=$rc, named=$named, stopped ${took} s after the kill: $([ $ok = 1 ] && echo ok || echo FAILED)"
    # 3b. rank 1 abandons its group as its layer's destroy starts, after the last collective
    #     (MOK_TEST_FAULT=abandon_at_destroy): the other ranks' destroys meet within the
    #     start-up limit (10 s here), give up saying so, and every rank exits 0 in time,
    #     where the collective deregistration would otherwise wait for rank 1 for good.
    log="$OUT/abandon_at_destroy_ep$n.log"
    start=$(date +%s)
    MOK_GROUP_START_TIMEOUT_MS=10000 timeout 180 "$BIN/mok" launch -n "$n" -- sh -c \
      "if [ \"\$MOK_RANK\" = 1 ]; then export MOK_TEST_FAULT=abandon_at_destroy; fi; exec \"$BIN/mok\" run \
       --backend cuda --ep-mode distributed --shape medium --ep $n --iters 2 --warmup 0" > "$log" 2>&1
    rc=$?
    took=$(( $(date +%s) - start ))
    met=$(grep -c "meeting to destroy the layer" "$log")  # (EpGroup::meet names it however it ends)
    ok=1
    [ $rc = 0 ] && [ "$met" -ge $(( n - 1 )) ] && [ $took -le 120 ] || { ok=0; FAILED=1; }
    row "EP=$n rank 1 abandons at its destroy: launcher rc=$rc, $met of $(( n - 1 )) peers gave up on it, ${took} s: $([ $ok = 1 ] && echo ok || echo FAILED)"
  fi
done

# 4. a layer on GPU 1 called from a thread whose current device is 0 (GpuDevices; it skips on
#    one GPU): it runs there, bit for bit as on GPU 0, and leaves the caller's device alone;
#    a stream of GPU 0 given to a layer on GPU 1 is refused naming it.
if [ "$gpus" -ge 2 ]; then
  log="$OUT/devices.log"
  if [ -x "$BIN/mok_gpu_tests" ]; then
    timeout 120 "$BIN/mok_gpu_tests" --gtest_filter='GpuDevices.*' > "$log" 2>&1
    rc=$?
  else
    echo "$BIN/mok_gpu_tests is missing" > "$log"
    rc=127
  fi
  passed=$(grep -c '^\[       OK \] GpuDevices' "$log")
  # (Every GpuDevices test the binary has: a new one must pass here too.)
  want=$("$BIN/mok_gpu_tests" --gtest_list_tests --gtest_filter='GpuDevices.*' 2> /dev/null | grep -c '^  ')
  v=$(verdict $rc "$passed" "$want")
  [ "$v" = ok ] || FAILED=1
  row "layers on GPU 1 with GPU 0 current, a stream of GPU 0 refused: rc=$rc, $passed of $want tests passed: $v"
fi

if [ $BENCH = 1 ]; then
  PYTHONUNBUFFERED=1 timeout ${BENCH_TIMEOUT:-500} python3 bench/run.py --mok-bin "$(printf %q "$BIN/mok")" --launch "$gpus" \
    --shapes qwen3.5-397b-a17b --tokens 2048 --results-dir "$OUT/results" --work-root "$work/bw" > "$OUT/bench.log" 2>&1
  rc=$?
  [ $rc = 0 ] || FAILED=1
  row "bench --launch $gpus qwen3.5 T=2048: rc=$rc; $(grep -E '^qwen3.5' "$OUT/bench.log" | tail -1 | sed 's/  */ /g')"
fi

echo
echo "==== device_multi ($gpus GPU(s)) ===="
printf '%s\n' "${table[@]}"
exit $FAILED
