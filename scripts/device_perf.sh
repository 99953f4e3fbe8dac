#!/usr/bin/env bash
# Where a forward's time goes, on a GPU machine: per-kernel device time of one forward
# (Nsight Compute, clocks as the GPU runs them), then the megakernel's tuning knobs swept with
# `mok run` (task bands, communication SMs) on the shapes given. Diagnostics for choosing
# defaults; the benchmark records come from bench/run.py, not from here.
#
#   scripts/device_perf.sh [--bin DIR] [--shapes a,b,...] [--bands 1,4,8] [--comm 4,8] [--ahead 2,6,11]
#                          [--pairs]   (also time --pairs, Config::task_pairs, at band 8)
#                          [--deep]    (ncu sections of the megakernel: tensor pipe, L2/HBM, stalls;
#                                       DEEP_KERNEL=schedule_count_kernel profiles another kernel)
#                          [--store-warp-off]  (also time MOK_STORE_WARP=0: consumers send the rows)
#                          [--cooperative]     (also time MOK_COOPERATIVE=1: cooperative megakernel launch)
#                          [--env NAME=v1,v2]  (also time each value of an environment knob, e.g.
#                                               MOK_PULL_GROUPS=1,2,3; repeatable)
#
# Output: $OUT/perf_<shape>_kernels.txt (ncu), $OUT/perf_<shape>_deep.txt (--deep),
# $OUT/perf.log; a short table last.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
BIN=build/bin
SHAPES="qwen3.5-397b-a17b,deepseek-v4-pro,qwen3-30b-a3b"
BANDS="1,2,4,8"
COMM=""
AHEAD=""
PAIRS=0
DEEP=0
DEEP_KERNEL=${DEEP_KERNEL:-forward_megakernel}
STORE_WARP_OFF=0
COOPERATIVE=0
ENV_AB=()
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) BIN=$2; shift 2 ;;
    --shapes) SHAPES=$2; shift 2 ;;
    --bands) BANDS=$2; shift 2 ;;
    --comm) COMM=$2; shift 2 ;;
    --ahead) AHEAD=$2; shift 2 ;;
    --pairs) PAIRS=1; shift ;;
    --deep) DEEP=1; shift ;;
    --store-warp-off) STORE_WARP_OFF=1; shift ;;
    --cooperative) COOPERATIVE=1; shift ;;
    --env)
      [[ "${2:-}" =~ ^MOK_[A-Z_]+=[^=]+$ ]] || { echo "device_perf: --env wants MOK_NAME=v1,v2 (got '${2:-}')" >&2; exit 2; }
      ENV_AB+=("$2"); shift 2 ;;
    *) echo "device_perf: unknown argument $1" >&2; exit 2 ;;
  esac
done
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
[ -x "$BIN/mok" ] || { echo "device_perf: $BIN/mok is missing (build first, or --bin DIR)" >&2; exit 1; }
table=()
KERNELS_PER_FORWARD=5  # count, offsets, scatter+plan, megakernel, epilogue (one GPU)

# The shape's own EP mode: MoK's shapes as one rank's EP-64 slice, the others at EP 1.
shape_args() {
  case "$1" in
    qwen3-30b-a3b) echo "--shape $1 --tokens 16384" ;;
    mixtral-8x7b|gpt-oss-20b) echo "--shape $1" ;;
    *) echo "--shape $1 --ep-mode slice" ;;
  esac
}

# One ncu pass over DEEP_KERNEL's 11th launch for the shape in $args. $1: output file,
# the rest: ncu options.
deep_run() {
  local f=$1; shift
  timeout 180 ncu --clock-control none --cache-control none -k "regex:$DEEP_KERNEL" --launch-skip 10 \
    --launch-count 1 "$@" "$BIN/mok" run --backend cuda $args --iters 3 --warmup 10 > "$f" 2>&1
}

forward_ms() { "$BIN/mok" run --backend cuda $1 --iters 50 --warmup 20 2>&1 | tee -a "$OUT/perf.log" |
  awk '$1 == "forward" {print $2}'; }

for shape in ${SHAPES//,/ }; do
  args=$(shape_args "$shape")
  if command -v ncu > /dev/null; then
    # Steady state: the 11th forward's kernels (10 warm-ups skipped), caches as the previous
    # kernel left them (ncu's default flushes them before each kernel, which makes the small
    # kernels look 1.5x slower than they run).
    timeout 120 ncu --clock-control none --cache-control none -k 'regex:schedule|stage|forward|combine' \
      --launch-skip $((10 * KERNELS_PER_FORWARD)) --launch-count $KERNELS_PER_FORWARD --metrics gpu__time_duration.sum \
      "$BIN/mok" run --backend cuda $args --iters 3 --warmup 10 > "$OUT/perf_${shape}_kernels.txt" 2>&1
    kernels=$(grep -E "^  [a-z_]+.*\(|gpu__time_duration" "$OUT/perf_${shape}_kernels.txt" |
      awk '/\(/ {k = ($1 == "void") ? $2 : $1; split(k, n, "("); name = n[1]; next} {printf "%s=%s%s ", name, $NF, $(NF-1)}')
    table+=("$shape kernels: $kernels")
    if [ $DEEP = 1 ]; then
      # Why the megakernel takes what it takes: how busy the tensor pipe is, the L2 and HBM
      # throughput, and where warps stall (one steady-state launch, replayed per section;
      # only the first pass sees the caches as the previous kernel left them).
      deep_run "$OUT/perf_${shape}_deep.txt" --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats
      # Metrics by name: the tensor pipe (this ncu has no separate GMMA counter on sm_90: it
      # reported n/a), L2 and HBM bytes per second.
      deep_run "$OUT/perf_${shape}_metrics.txt" --metrics \
        sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum.per_second,dram__bytes.sum.per_second
      deep=$(grep -E "^ +(sm__pipe_tensor|lts__t_bytes|dram__bytes)" "$OUT/perf_${shape}_metrics.txt" |
        awk '{printf "%s=%s%s ", $1, $NF, $(NF-1)}')
      table+=("$shape $DEEP_KERNEL: $deep")
    fi
  fi
  line="$shape forward ms: default=$(forward_ms "$args")"
  for b in ${BANDS//,/ }; do line+=" band$b=$(forward_ms "$args --band $b")"; done
  for c in ${COMM//,/ }; do line+=" comm$c=$(forward_ms "$args --comm-sms $c")"; done
  for a in ${AHEAD//,/ }; do line+=" ahead$a=$(MOK_PULL_AHEAD=$a forward_ms "$args")"; done
  [ $PAIRS = 1 ] && line+=" pairs_band8=$(forward_ms "$args --pairs --band 8")"
  [ $STORE_WARP_OFF = 1 ] && line+=" store_warp_off=$(MOK_STORE_WARP=0 forward_ms "$args")"
  for ab in ${ENV_AB[@]+"${ENV_AB[@]}"}; do
    name=${ab%%=*}
    # (The export lives in the command substitution's subshell: one timing only.)
    for v in $(echo "${ab#*=}" | tr ',' ' '); do line+=" $name=$v:$(export "$name=$v"; forward_ms "$args")"; done
  done
  # Again after the variants: the default timed twice brackets any drift between them.
  [ $COOPERATIVE = 1 ] && line+=" cooperative=$(MOK_COOPERATIVE=1 forward_ms "$args") default_again=$(forward_ms "$args")"
  table+=("$line")
done

echo
echo "==== device_perf ===="
printf '%s\n' "${table[@]}" | tee "$OUT/perf_table.txt"
