"""Numerical checks and timing statistics shared by the benchmark scripts.

Pure Python: nothing here imports torch. `compare` takes the array module as an argument
(numpy on the CPU, torch on the GPU) so the same arithmetic runs in the tests and on the
device.
"""

import hashlib
import os

# The files whose code makes each peer: a record names the peer it was measured against by a
# hash of their bytes (peer_code), so that records against an earlier peer are told apart.
PEER_FILES = {"peer_torch": ("peer_torch.py", "checks.py", "workdir.py"),
              "peer_dist": ("peer_dist.py", "peer_torch.py", "checks.py", "workdir.py")}


def peer_code(tool, bench_dir=None):
    """The peer `tool` ("peer_torch" or "peer_dist") as "<tool>:<12 hex digits of sha256 over its
    files' bytes>" (PEER_FILES, read from `bench_dir`, default this file's directory)."""
    bench_dir = bench_dir or os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for name in PEER_FILES[tool]:
        with open(os.path.join(bench_dir, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    return f"{tool}:{h.hexdigest()[:12]}"


# MoK's bars (MISSION.md "Reference numbers"), the same as mok_tolerance() in
# src/core/compare.cpp: max-abs error and sum|diff|/sum|ref|.
TOLERANCES = {
    "bf16": {"max_abs": 0.5, "rel": 0.01},
    "mxfp8": {"max_abs": 1.0, "rel": 0.1},
}


def tolerance(precision):
    """MoK's forward bar for a precision name ("bf16" or "mxfp8")."""
    try:
        return dict(TOLERANCES[precision])
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}; known: {sorted(TOLERANCES)}") from None


def compare(out, ref, xp):
    """Compares `out` with `ref` (same shape, float32 arrays of module `xp`) as mok does.

    An element where out or ref is NaN or Inf counts in `non_finite` (and so fails the check),
    except the same infinity in both, which agree: a reference that overflowed or is poisoned
    checks nothing, so it must not pass (src/core/compare.cpp has the same rule). Non-finite
    elements are left out of max_abs and rel. Sums are taken in float64.
    Returns a dict of plain Python numbers: max_abs, rel, non_finite, count.
    """
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"compare: shapes differ: {tuple(out.shape)} vs {tuple(ref.shape)}")
    both = xp.isfinite(ref) & xp.isfinite(out)
    same_inf = xp.isinf(ref) & (out == ref)
    non_finite = int((~both & ~same_inf).sum())
    zero = xp.zeros_like(ref)
    diff = xp.where(both, xp.abs(out - ref), zero)
    mag = xp.where(both, xp.abs(ref), zero)
    count = 1
    for d in tuple(ref.shape):
        count *= int(d)
    max_abs = float(diff.max()) if count else 0.0
    sum_diff = float(diff.sum(dtype=xp.float64))
    sum_ref = float(mag.sum(dtype=xp.float64))
    if sum_ref > 0:
        rel = sum_diff / sum_ref
    else:
        rel = float("inf") if sum_diff > 0 else 0.0
    return {"max_abs": max_abs, "rel": rel, "non_finite": non_finite, "count": count}


def passes(stats, tol):
    """True when a `compare` result meets a `tolerance`; NaN never passes."""
    max_abs, rel = stats["max_abs"], stats["rel"]
    # Comparisons with NaN are False, so a NaN in either number fails here.
    return bool(stats["non_finite"] == 0 and max_abs <= tol["max_abs"] and rel <= tol["rel"])


def slowest_per_iteration(per_rank):
    """[rank][iteration] ms -> per iteration the slowest rank's time (how a group's figure is
    made: an iteration ends when its last rank does)."""
    return [max(col) for col in zip(*per_rank)]


def summarize_ms(samples):
    """Median, min and max of per-iteration times in ms.

    The median is sorted[n // 2] (the upper median for even n), as `mok run` computes it.
    """
    if not samples:
        raise ValueError("summarize_ms: no samples")
    s = sorted(float(x) for x in samples)
    return {"median_ms": s[len(s) // 2], "min_ms": s[0], "max_ms": s[-1], "samples": len(s)}


# MoK's timing contract: 500 warm-up and 100 timed iterations, for mok and its peer alike.
# Records made otherwise (and records without a peer) are not compared with those made so
# (records.contract_breaks, the report's "Off-contract records").
WARMUP = 500
ITERS = 100
CEILING_WARMUP = 500
CEILING_ITERS = 200


def add_timing_options(ap):
    """The warm-up and timed-iteration options every peer script takes (MoK's defaults)."""
    ap.add_argument("--warmup", type=int, default=WARMUP)
    ap.add_argument("--iters", type=int, default=ITERS)
    # The ceilings run long enough to reach the clocks the GPU sustains under a power-bound
    # load, like the timed runs they are compared with: with 20/50 an 8192^3 bf16 GEMM on the
    # H200 swung between 1.37 and 1.69 ms within one run (median 651..793 TFLOP/s over 20
    # records), ~0.1 s of work, while the power management was still settling.
    ap.add_argument("--ceiling-warmup", type=int, default=CEILING_WARMUP)
    ap.add_argument("--ceiling-iters", type=int, default=CEILING_ITERS)


def timed_window(samples_ms, end_unix_s):
    """[start, end] in Unix seconds of a timed loop read back at `end_unix_s` (the host clock
    just after its closing synchronisation): its iterations ran back to back on the GPU, so it
    began their summed time earlier. (Gaps between iterations, if any, put the true start a
    little earlier still.) The clock samples of a record are taken inside this window."""
    return [end_unix_s - sum(float(x) for x in samples_ms) / 1e3, end_unix_s]
