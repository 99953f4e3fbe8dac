#!/usr/bin/env bash
# Checks the megakernel's machine code, no GPU needed:
#   - its wgmmas are there: at least the mainloop's four HGMMA (m64n256k16) per k-block (ptxas
#     deletes wgmmas whose accumulators nobody reads: a leave-one-out build once kept 1 of 4);
#   - no stack frame and no local memory (no spills);
#   - the code warpgroup 0 (the producer, the store warp and the gather warps) runs after
#     setmaxnreg.dec stays inside the budget it releases to (scripts/check_setmaxnreg.py).
#
#   scripts/check_sass.sh BIN_DIR [OUT_DIR]     (BIN_DIR/mok; OUT_DIR gets megakernel.sass)
#
# cuobjdump: $CUOBJDUMP, else the one on PATH or in /usr/local/cuda/bin, else the pinned wheels
# of scripts/requirements-sass.txt in .venv-sass (installed on first use). Prints one line
# "sass: ..."; exits 3 when BIN_DIR/mok holds no device code at all (built without the CUDA
# backend), 1 when a check fails (device code without sm_90a, or cuobjdump failing, included),
# 0 otherwise.
set -uo pipefail
BIN=$(realpath -m "${1:?usage: scripts/check_sass.sh BIN_DIR [OUT_DIR]}")
OUT=$(realpath -m "${2:-$BIN/../sass}")
cd "$(dirname "$0")/.."
KERNEL=_ZN3mok4cuda18forward_megakernelENS0_13ForwardParamsE
MIN_HGMMA=4  # kTileK / 16 m64n256k16 steps per k-block (megakernel.cuh: consumer_loop)
mkdir -p "$OUT"

if [ -n "${CUOBJDUMP:-}" ]; then
  tool=$CUOBJDUMP
elif command -v cuobjdump > /dev/null; then
  tool=cuobjdump
elif [ -x /usr/local/cuda/bin/cuobjdump ]; then
  export PATH=/usr/local/cuda/bin:$PATH  # cuobjdump runs nvdisasm from PATH
  tool=/usr/local/cuda/bin/cuobjdump
else
  # The venv holds exactly requirements-sass.txt's pins, or is made again (pins changed since,
  # or an install that failed part way).
  if ! cmp -s scripts/requirements-sass.txt .venv-sass/installed-requirements.txt ||
     ! ls .venv-sass/lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump > /dev/null 2>&1; then
    rm -rf .venv-sass
    { python3 -m venv .venv-sass && .venv-sass/bin/pip install -q -r scripts/requirements-sass.txt &&
      cp scripts/requirements-sass.txt .venv-sass/installed-requirements.txt; } > "$OUT/install.log" 2>&1 ||
      { echo "sass: FAILED: installing cuobjdump (scripts/requirements-sass.txt) failed: $(tail -1 "$OUT/install.log")"; exit 1; }
  fi
  bindir=$(dirname "$(ls .venv-sass/lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump | head -1)")
  export PATH=$bindir:$PATH  # cuobjdump runs nvdisasm from PATH
  tool=$bindir/cuobjdump
fi

[ -f "$BIN/mok" ] || { echo "sass: FAILED: no $BIN/mok"; exit 1; }
# (Not piped into grep -q: pipefail and SIGPIPE.) Only cuobjdump's own "no device code" is a
# build without the CUDA backend; any other failure of the tool is a failure of the check.
elves=$("$tool" --list-elf "$BIN/mok" 2>&1); elves_rc=$?
if grep -q "does not contain device code" <<< "$elves"; then
  echo "sass: skipped: $BIN/mok holds no device code (mok was built without the CUDA backend)"
  exit 3
fi
if [ $elves_rc != 0 ] || ! grep -q sm_90a <<< "$elves"; then
  echo "sass: FAILED: $tool --list-elf $BIN/mok (exit $elves_rc) lists no sm_90a code: $(head -c 300 <<< "$elves")"
  exit 1
fi
"$tool" --dump-sass -fun "$KERNEL" "$BIN/mok" > "$OUT/megakernel.sass" 2>&1
usage=$("$tool" --dump-resource-usage "$BIN/mok" 2>&1 | grep -A1 "$KERNEL" | tail -1)
hgmma=$(grep -c HGMMA "$OUT/megakernel.sass")
reg=$(echo "$usage" | grep -o 'REG:[0-9]*' | cut -d: -f2)
stack=$(echo "$usage" | grep -o 'STACK:[0-9]*' | cut -d: -f2)
local_mem=$(echo "$usage" | grep -o 'LOCAL:[0-9]*' | cut -d: -f2)
fail=()
[ "${hgmma:-0}" -ge $MIN_HGMMA ] || fail+=("HGMMA $hgmma < $MIN_HGMMA: wgmmas were removed or never emitted")
[ "${stack:-x}" = 0 ] || fail+=("stack frame ${stack:-unknown} bytes (spills?)")
[ "${local_mem:-x}" = 0 ] || fail+=("local memory ${local_mem:-unknown} bytes (spills?)")
if ! regs=$(python3 scripts/check_setmaxnreg.py "$OUT/megakernel.sass" 2>&1); then fail+=("setmaxnreg: $regs"); fi
line="megakernel HGMMA $hgmma, REG $reg, STACK $stack, LOCAL $local_mem; $(echo "$regs" | tr '\n' ' ')"
if [ ${#fail[@]} -gt 0 ]; then
  echo "sass: FAILED: $(IFS='; '; echo "${fail[*]}") ($line)"
  exit 1
fi
echo "sass: ok: $line"
