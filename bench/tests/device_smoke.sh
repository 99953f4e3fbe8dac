#!/usr/bin/env bash
# Exercises the GPU side of bench/ on a CUDA machine WITHOUT the real `mok bench`:
# synthetic work directories (synth_workdir.py) feed peer_torch.py, and run.py is driven by
# fake_mok.py. Checks that the peer runs, passes its check on known-good inputs, FAILS it on
# corrupted inputs, and that run.py + report.py produce a record and a report.
#     bash bench/tests/device_smoke.sh [OUTDIR]      (default: /tmp/mok_bench_smoke)
# Synthetic numbers only: never copy anything it writes into bench/results/.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${1:-/tmp/mok_bench_smoke}
rm -rf "$OUT_DIR"; mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
Q="--warmup 5 --iters 10 --ceiling-warmup 3 --ceiling-iters 10"

echo "== CPU unit tests"
$PY -m unittest discover -s bench/tests 2>&1 | tail -3

echo "== 1. small slice, one shared expert"
$PY bench/tests/synth_workdir.py "$OUT_DIR/w1"
$PY bench/peer_torch.py "$OUT_DIR/w1" $Q
echo "== 2. EP=1, no shared expert, clamped SwiGLU"
$PY bench/tests/synth_workdir.py "$OUT_DIR/w2" --ep 1 --ep-mode all --experts 4 --shared none --swiglu-limit 0.5
$PY bench/peer_torch.py "$OUT_DIR/w2" $Q --no-ceilings
echo "== 3. corrupted reference: the peer must refuse to time (exit 1, check FAIL)"
$PY bench/tests/synth_workdir.py "$OUT_DIR/w3"
$PY - "$OUT_DIR/w3" <<'EOF'
import sys, numpy as np
p = sys.argv[1] + "/rows_ref.npy"
a = np.load(p); a[:] = a[::-1].copy(); np.save(p, a)
EOF
if $PY bench/peer_torch.py "$OUT_DIR/w3" $Q --no-ceilings; then echo "FAILED: corrupted work passed"; exit 1; fi
$PY - "$OUT_DIR/w3/peer.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["check"]["passes"] is False and d["forward"] is None and "forward" in d["skipped"], d["check"]
print("corrupted work refused as expected:", d["skipped"]["forward"])
EOF
echo "== 4. a Qwen3.5-like rank: 8 local experts, H=4096, I=1024, k=10, T=2048 (N ~ 20480)"
$PY bench/tests/synth_workdir.py "$OUT_DIR/w4" --experts 16 --ep 2 --hidden 4096 --intermediate 1024 \
    --topk 10 --shared 1024 --tokens 2048
$PY bench/peer_torch.py "$OUT_DIR/w4" --warmup 50 --iters 100
echo "== 5. run.py with a fake mok, the real peer, then report.py"
$PY bench/run.py --mok-bin "$PY bench/tests/fake_mok.py" --shapes glm-5.2,gpt-oss-20b --tokens 64 \
    --warmup 5 --iters 10 --ceiling-warmup 3 --ceiling-iters 10 \
    --work-root "$OUT_DIR/work" --results-dir "$OUT_DIR/results"
$PY bench/report.py --results-dir "$OUT_DIR/results" --out "$OUT_DIR/REPORT.md" --plots-dir "$OUT_DIR/plots"
for w in w1 w2 w4; do
  $PY - "$OUT_DIR/$w/peer.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
c = d["check"]
f = lambda e: None if not e else round(e["median_ms"], 4)
print(sys.argv[1], "check", c["passes"], "rows", c["rows"]["max_abs"], c["rows"]["rel"], "y", c["y"]["max_abs"],
      c["y"]["rel"], "| fwd", f(d["forward"]), "gemms", f(d["grouped_gemms"]), "bwd", f(d["backward"]),
      "grads finite", (d["backward"] or {}).get("grads_finite"),
      "| ceilings", {k: (v or {}).get("tflops", (v or {}).get("gbps")) for k, v in d["ceilings"].items()},
      "| errors", d["errors"])
EOF
done
echo "device smoke: OK"
