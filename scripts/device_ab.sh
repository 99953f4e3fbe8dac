#!/usr/bin/env bash
# A/B of two mok builds on one machine: `mok run` of each on the same shapes, alternating in
# rounds (base-new, then new-base, so neither always runs first), one forward median per run.
# A diagnostic for deciding whether a change is faster; benchmark records come from
# bench/run.py. One machine's spread can exceed a small gain (docs/PERFORMANCE.md, "Between
# two tiles": 3% on one H100, noise on the next), so rerun a gain under ~2% on another
# machine before believing it.
#
#   scripts/device_ab.sh --base MOK --new MOK [--shapes a,b,...] [--rounds N] [-- RUN_ARGS...]
#
# MOK: a mok binary (build one per commit and carry both). RUN_ARGS go to every `mok run`
# (default: --iters 200 --warmup 100; a shape's tokens may be given there too).
# Output: $OUT/ab_<shape>_<base|new>_<round>.log, $OUT/ab.txt (one line per run), a short
# table last: per shape the median over rounds of each binary's forward median, and new/base.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
BASE="" NEW="" SHAPES="qwen3.5-397b-a17b,deepseek-v4-pro,qwen3-30b-a3b" ROUNDS=3
RUN_ARGS=(--iters 200 --warmup 100)
while [ $# -gt 0 ]; do
  case "$1" in
    --base) BASE=$2; shift 2 ;;
    --new) NEW=$2; shift 2 ;;
    --shapes) SHAPES=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --) shift; RUN_ARGS=("$@"); break ;;
    *) echo "device_ab: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
for b in "$BASE" "$NEW"; do
  [ -n "$b" ] || { echo "device_ab: --base and --new are both required (mok binaries)" >&2; exit 2; }
  [ -x "$b" ] || { echo "device_ab: $b: not an executable file" >&2; exit 2; }
done
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "device_ab: --rounds must be a positive integer, got '$ROUNDS'" >&2; exit 2; }
mkdir -p "$OUT"
: > "$OUT/ab.txt"
echo "base: $("$BASE" version)" | tee -a "$OUT/ab.txt"
echo "new:  $("$NEW" version)" | tee -a "$OUT/ab.txt"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name --format=csv,noheader | sed 's/^/gpu:  /' | tee -a "$OUT/ab.txt"

failed=0
# One run: prints its forward median (ms), or nothing when the run failed (its log says why).
run_one() {  # which shape round
  local bin=$BASE; [ "$1" = new ] && bin=$NEW
  local log="$OUT/ab_$2_$1_$3.log"
  if "$bin" run --shape "$2" "${RUN_ARGS[@]}" > "$log" 2>&1; then
    awk '$1 == "forward" { print $2; exit }' "$log"
  fi
}
IFS=, read -r -a shape_list <<< "$SHAPES"
table=()
for shape in "${shape_list[@]}"; do
  base_ms=() new_ms=()
  for ((r = 1; r <= ROUNDS; r++)); do
    order="base new"; (( r % 2 == 0 )) && order="new base"
    for which in $order; do
      ms=$(run_one "$which" "$shape" "$r")
      if [ -z "$ms" ]; then
        echo "$shape $which round $r: FAILED ($OUT/ab_${shape}_${which}_$r.log)" | tee -a "$OUT/ab.txt"
        failed=1
        continue
      fi
      echo "$shape $which round $r: forward $ms ms" | tee -a "$OUT/ab.txt"
      if [ "$which" = base ]; then base_ms+=("$ms"); else new_ms+=("$ms"); fi
    done
  done
  if [ ${#base_ms[@]} -gt 0 ] && [ ${#new_ms[@]} -gt 0 ]; then
    table+=("$(python3 - "$shape" "${base_ms[*]}" "${new_ms[*]}" <<'EOF'
import statistics, sys
shape, base, new = sys.argv[1], [float(v) for v in sys.argv[2].split()], [float(v) for v in sys.argv[3].split()]
b, n = statistics.median(base), statistics.median(new)
print(f"{shape:<22} base {b:8.3f} ms ({min(base):.3f}-{max(base):.3f})  new {n:8.3f} ms "
      f"({min(new):.3f}-{max(new):.3f})  new/base {n / b:.3f}")
EOF
)")
  else
    table+=("$shape: no pair of runs to compare")
  fi
done
echo
echo "==== A/B (medians over $ROUNDS round(s) of each run's forward median) ===="
printf '%s\n' "${table[@]}" | tee -a "$OUT/ab.txt"
exit $failed
