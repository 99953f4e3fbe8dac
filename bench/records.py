"""Benchmark records: the arithmetic (FLOPs, bytes, ratios) and the record files.

Pure Python, no torch, no numpy. A record is built only from mok.json (written by
`mok bench`), peer.json (written by peer_torch.py) and the environment (git, the clock):
nothing in it is typed by hand. bench/README.md describes every field.
"""
import copy
import datetime
import glob
import json
import math
import os
import re
import subprocess
import sys

import checks
import gpu_clocks
import workdir

SCHEMA = 1
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")


# ---- arithmetic -------------------------------------------------------------------------

def _dims(problem):
    T, H, I, k = (int(problem[key]) for key in ("tokens_per_rank", "hidden", "intermediate", "top_k"))
    E, R = int(problem["num_experts"]), int(problem["ep_size"])
    return T, H, I, k, E, R, [int(w) for w in problem.get("shared_intermediate") or []]


def mok_flops(problem, backward=False):
    """MoK's FLOP count for one rank: 6*(T + T*k)*H*I forward (the shared expert counted as T
    rows of width I, whatever the shapes' shared experts are), twice that backward."""
    T, H, I, k, _, _, _ = _dims(problem)
    f = 6.0 * (T + T * k) * H * I
    return 2.0 * f if backward else f


def performed_flops(problem, n_rows, backward=False):
    """FLOPs the rank actually performs: 6*N*H*I for its N routed rows plus 6*T*H*I_s for each
    shared expert (twice that backward). Equals mok_flops for MoK's shapes when N = T*k."""
    T, H, I, _, _, _, shared = _dims(problem)
    f = 6.0 * n_rows * H * I + sum(6.0 * T * H * w for w in shared)
    return 2.0 * f if backward else f


def grouped_gemm_flops(problem, n_rows):
    """FLOPs of the two routed grouped GEMMs alone: gate/up 2*N*H*2I + down 2*N*I*H."""
    _, H, I, _, _, _, _ = _dims(problem)
    return 6.0 * n_rows * H * I


def tflops(flops, ms):
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def hbm_bytes_forward(problem, n_rows):
    """Minimum bytes through HBM of one rank's forward (bf16 = 2 bytes):
    routed x rows read N*H*2 + the rank's weights read once (3*E_loc*I*H*2 + sum_s 3*I_s*H*2)
    + x_local read for the shared experts T*H*2 (only when there is one)
    + combine rows written N*H*2 + epilogue reads T*k*H*2 + y written T*H*2."""
    T, H, I, k, E, R, shared = _dims(problem)
    e_loc = E // R
    weights = 3 * e_loc * I * H * 2 + sum(3 * w * H * 2 for w in shared)
    x_local = T * H * 2 if shared else 0
    return n_rows * H * 2 + weights + x_local + n_rows * H * 2 + T * k * H * 2 + T * H * 2


def link_bytes_forward(problem, n_remote):
    """Bytes over the links in one rank's forward: rows pulled from and pushed to other ranks."""
    _, H, _, _, _, _, _ = _dims(problem)
    return 2 * n_remote * H * 2


def gbps(nbytes, ms):
    if ms is None or ms <= 0:
        return None
    return nbytes / (ms * 1e-3) / 1e9


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


# ---- environment ------------------------------------------------------------------------

def _git(args, cwd):
    try:
        r = subprocess.run(["git"] + args, cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


COMMIT_ENV, DIRTY_ENV = "MOK_BENCH_COMMIT", "MOK_BENCH_DIRTY"


def same_commit(a, b):
    """Whether two commit names are one commit: equal, or one an abbreviation (a prefix) of the
    other (mok's binary stamps 12 hex digits, a caller may give 7 or 40)."""
    a, b = str(a).strip().lower(), str(b).strip().lower()
    return bool(a) and bool(b) and (a.startswith(b) or b.startswith(a))


def _env_commit():
    """(sha, dirty) from MOK_BENCH_COMMIT / MOK_BENCH_DIRTY, or None when the first is unset.
    dirty is None (unknown, never shown as clean) when MOK_BENCH_DIRTY is unset."""
    sha = os.environ.get(COMMIT_ENV, "").strip()
    if not sha:
        return None
    if not re.fullmatch(r"[0-9a-fA-F]{7,40}", sha):
        raise ValueError(f"{COMMIT_ENV}={sha!r}: must be a commit's hex sha, 7 to 40 digits")
    flag = os.environ.get(DIRTY_ENV, "").strip()
    if flag not in ("", "0", "1"):
        raise ValueError(f"{DIRTY_ENV}={flag!r}: must be 0 (clean tree) or 1 (modified tree), or unset")
    return sha, {"1": True, "0": False}.get(flag)


def collect_env(repo_root=REPO_ROOT, mok_json=None):
    """The commit measured and the UTC date.

    In order: mok.json's "build" object ({"commit": ..., "dirty": ...}), the commit the timed
    `mok` binary was built from; else the MOK_BENCH_COMMIT environment variable
    (MOK_BENCH_DIRTY=1/0; unset: dirty unknown); else, for a binary stamped "unknown" (built
    outside a git checkout), "unknown"; else git rev-parse HEAD of this tree (and whether it
    is dirty); else "unknown". `source` says which. The binary's stamp wins because
    it is what was timed: a variable exported once in a shell outlives rebuilds, and a copy of
    the tree on another machine can carry an older .git than the code it holds (seen on the
    device). A MOK_BENCH_COMMIT that names another commit than the binary's stamp is a
    ValueError naming both (run.py makes it that run's error): one of them is wrong, and a
    record must not guess which.
    """
    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    build = mok_json.get("build") if isinstance(mok_json, dict) else None
    given = _env_commit()
    if isinstance(build, dict) and build.get("commit") and build["commit"] != "unknown":
        stamp = str(build["commit"]).strip().lower()
        if not re.fullmatch(r"[0-9a-f]{7,40}", stamp):
            # (Refused here, before the peer runs: a record must name a commit load_record takes.)
            raise ValueError(f"mok.json build.commit {build['commit']!r} is not a commit's hex sha (7 to 40 digits)")
        if given is not None and not same_commit(given[0], stamp):
            raise ValueError(f"{COMMIT_ENV}={given[0]} names another commit than the timed binary's stamp "
                             f"(mok.json build.commit {stamp}); unset it or rebuild mok")
        dirty = build.get("dirty")
        env["commit"] = {"sha": stamp, "dirty": dirty if isinstance(dirty, bool) else None,
                         "source": "mok.json build"}
        return env
    if given is not None:
        env["commit"] = {"sha": given[0].lower(), "dirty": given[1], "source": COMMIT_ENV}
        return env
    if isinstance(build, dict) and build.get("commit") == "unknown":
        # A binary built outside a git checkout: the tree run.py runs from need not be the one
        # that built it, so its HEAD is not taken for the binary's.
        dirty = build.get("dirty")
        env["commit"] = {"sha": "unknown", "dirty": dirty if isinstance(dirty, bool) else None,
                         "source": "mok.json build"}
        return env
    top = _git(["rev-parse", "--show-toplevel"], repo_root)
    # Only this repository's own .git counts (not one of a folder above a copy of the tree).
    in_repo = top is not None and os.path.realpath(top) == os.path.realpath(repo_root)
    sha = _git(["rev-parse", "HEAD"], repo_root) if in_repo else None
    if sha:
        status = _git(["status", "--porcelain", "--untracked-files=no"], repo_root)
        env["commit"] = {"sha": sha, "dirty": None if status is None else bool(status), "source": "git"}
    else:
        env["commit"] = {"sha": "unknown", "dirty": None, "source": "none"}
    return env


# ---- the record -------------------------------------------------------------------------

def _timed(entry, flops=None):
    """A copy of a {median_ms, min_ms, max_ms, ...} entry, with TFLOP/s when flops is given."""
    if not entry:
        return None
    out = {key: entry[key] for key in ("median_ms", "min_ms", "max_ms") if key in entry}
    if flops is not None:
        out["tflops"] = tflops(flops, out.get("median_ms"))
    return out


PHASE_ORDER = ("setup", "schedule", "megakernel", "group_barrier", "epilogue")


def forward_phases(mok):
    """mok.json's forward_phases as {"iters", "method", "median_ms": {phase: ms}} and, from
    binaries that time forwards right after the pass, "timed_after_ms" (their median: PDL on,
    no events between the phases), or None when the run did not measure them (older binaries)
    or the entry is malformed."""
    ph = mok.get("forward_phases")
    if not isinstance(ph, dict) or not isinstance(ph.get("median_ms"), dict):
        return None
    med = {}
    for name, v in ph["median_ms"].items():
        if not _finite_at_least_0(v):  # (what load_record holds a record's phases to)
            return None
        med[str(name)] = float(v)
    out = {"iters": ph.get("iters"), "method": ph.get("method"), "median_ms": med}
    after = ph.get("timed_after_ms")
    if after is not None:
        if not _finite_at_least_0(after):
            return None
        out["timed_after_ms"] = float(after)
    return out


def merge_group(moks):
    """The mok part of one record for a real EP group, from every rank's mok.json (rank
    order): per timed iteration the slowest rank (MoK's method), the rows of the rank with the
    most and the remote rows of the rank that moved the most, the check passing only when every
    rank's does; each rank's own figures are kept under "ranks"."""
    if not moks:
        raise ValueError("merge_group: no ranks")
    iters = [m.get("forward_iters_ms") for m in moks]
    if not all(iters) or len({len(i) for i in iters}) != 1:
        raise ValueError("merge_group: every rank's mok.json needs forward_iters_ms of one length")
    worst = checks.slowest_per_iteration(iters)
    out = copy.deepcopy(moks[0])
    out["ep_mode"] = "distributed"
    out["active_rank"] = None
    out["forward"] = checks.summarize_ms(worst)
    out["forward_iters_ms"] = worst
    # Rows (and so the performed FLOPs and HBM bytes) of the rank with the most rows, the one
    # that sets the pace; link bytes of the rank that moved the most rows over NVLink.
    busiest = max(moks, key=lambda m: int(m["rows"].get("real", 0)))
    out["rows"] = dict(busiest["rows"])
    out["rows"]["remote"] = max(int(m["rows"].get("remote", 0)) for m in moks)
    rank_checks = [((m.get("check") or {}).get("forward") or {}) for m in moks]
    out["check"] = {"forward": {"passes": all(c.get("passes") is True for c in rank_checks),
                                "max_abs": max(float(c.get("max_abs", float("inf"))) for c in rank_checks),
                                "rel": max(float(c.get("rel", float("inf"))) for c in rank_checks)}}
    phases = [forward_phases(m) for m in moks]
    if all(phases) and len({tuple(sorted(p["median_ms"])) for p in phases}) == 1:
        # Per phase the slowest rank's median (each rank measured its own split).
        out["forward_phases"] = dict(phases[0], median_ms={
            name: max(p["median_ms"][name] for p in phases) for name in phases[0]["median_ms"]})
        afters = [p.get("timed_after_ms") for p in phases]
        if all(a is not None for a in afters):
            out["forward_phases"]["timed_after_ms"] = max(afters)  # (the ranks ran in lockstep)
        else:
            out["forward_phases"].pop("timed_after_ms", None)
    else:
        out.pop("forward_phases", None)
    out["ranks"] = [{"rank": r, "forward": m.get("forward"), "rows": m.get("rows"),
                     "check": ((m.get("check") or {}).get("forward"))} for r, m in enumerate(moks)]
    return out


CLOCKS_METHOD = ("nvidia-smi --query-gpu (clocks.sm, power.draw.instant, clock event reasons) every period_ms "
                 "beside the timed programs; per timed loop the samples inside its window (the Unix times "
                 "its program wrote: the end after the last synchronisation, minus the summed iteration times)")


def pj_per_flop(power_w, tflops_rate):
    """Board energy per FLOP in picojoules: power over rate (1 W per TFLOP/s is 1 pJ per FLOP)."""
    if power_w is None or not tflops_rate:
        return None
    return power_w / tflops_rate


def clock_section(mok, peer, clocks, capability, sms, mok_performed_tflops, dense_tflops):
    """The record's "clocks": per timed loop the SM clock and power sampled inside its window
    (gpu_clocks.window_summary), and the tensor cores' dense bf16 peak at mok's clock. None
    when the run did not sample (run.py --no-clocks, or a caller that passes no samples)."""
    if clocks is None:
        return None
    out = {"method": CLOCKS_METHOD, "period_ms": clocks.get("period_ms"), "gpus": clocks.get("gpus"),
           "error": clocks.get("error")}
    samples = clocks.get("samples") or []
    gpus = set(clocks["gpus"]) if clocks.get("gpus") is not None else None
    # The ceilings run on one GPU (a group's: rank 0's, the first sampled), the others idle
    # meanwhile: their loops are summarised over that GPU alone.
    one_gpu = {clocks["gpus"][0]} if clocks.get("gpus") else None
    windows = gpu_clocks.timed_windows(mok, peer)
    for name, window in windows.items():
        out[name] = gpu_clocks.window_summary(samples, window, one_gpu if name == "dense_bf16_ceiling" else gpus)
    # Whether a loop's spread is the clock's (the power cap moving it) or the work's: its
    # iterations' times against the clock sampled inside each. One GPU's loops only: a group's
    # times are each iteration's slowest rank, its window rank 0's own, and its loop pauses
    # for a synchronisation and an untimed forward every 50 calls (core/device_timer.h), so
    # its iterations cannot be placed in time from their durations.
    loops = () if mok.get("ep_mode") == "distributed" else (
        ("mok_forward", mok.get("forward_iters_ms")),
        ("pytorch_forward", ((peer or {}).get("forward") or {}).get("iters_ms")))
    for name, iters in loops:
        if isinstance(out.get(name), dict) and isinstance(iters, list) and all(_finite_at_least_0(v) for v in iters):
            out[name]["iterations"] = gpu_clocks.clock_following(
                gpu_clocks.iteration_clock_pairs(samples, windows[name], iters, one_gpu))
    mok_loop = out.get("mok_forward") or {}
    dense_loop = out.get("dense_bf16_ceiling") or {}
    peak = gpu_clocks.tensor_peak_tflops(capability, sms, mok_loop.get("sm_mhz_median"))
    out["tensor_peak_bf16_tflops_at_mok_clock"] = peak
    out["mok_forward_performed_of_tensor_peak"] = ratio(mok_performed_tflops, peak)
    out["dense_bf16_of_tensor_peak_at_its_clock"] = ratio(
        dense_tflops, gpu_clocks.tensor_peak_tflops(capability, sms, dense_loop.get("sm_mhz_median")))
    # At the power cap a kernel's time is its energy over the capped power, so energy per FLOP
    # (board power in the loop over its rate) says how far a layer is from the dense GEMM.
    out["mok_forward_pj_per_flop"] = pj_per_flop(mok_loop.get("power_w_median"), mok_performed_tflops)
    out["dense_bf16_pj_per_flop"] = pj_per_flop(dense_loop.get("power_w_median"), dense_tflops)
    return out


def check_passes(check, source, key):
    """A check object's verdict: its "passes" as a real bool (missing: False, a check that says
    nothing does not pass). Anything else (the string "false", 1, null) is a ValueError naming
    the file and the key: bool("false") is True, and must never read as PASS."""
    if not isinstance(check, dict):
        raise ValueError(f"{source}: '{key}' must be an object (got {json.dumps(check)[:40]})")
    if "passes" not in check:
        return False
    verdict = check["passes"]
    if not isinstance(verdict, bool):
        raise ValueError(f"{source}: '{key}.passes' must be true or false (got {json.dumps(verdict)[:40]})")
    return verdict


def strict_json(value):
    """`value` with every non-finite float (a check's rel over a zero reference, inf) written as
    the string "inf", "-inf" or "nan": a record is strict JSON (json.dump(allow_nan=False)),
    which other readers than Python's accept, and no figure is dropped."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def derived_figures(problem, n_rows, n_remote, medians, dense, copy, a2a):
    """The figures a record works out from its medians, ceilings and problem, in the record's
    own layout (make_record stores them; derived_errors checks a loaded record's against them):
    "flops", "bytes" and "ratios", and each timed entry's TFLOP/s by MoK's count and by the
    FLOPs really performed (backward: twice the forward's GEMM FLOPs). `medians`: the median ms
    (None: not measured) of "mok_fwd", "mok_bwd", "pipe_fwd", "pipe_bwd" and "gg" (the grouped
    GEMMs); `dense`, `copy`, `a2a`: the dense bf16 TFLOP/s, the copy GB/s and NCCL's all-to-all
    bus GB/s (None: not measured)."""
    f_fwd, f_bwd = mok_flops(problem), mok_flops(problem, backward=True)
    perf = performed_flops(problem, n_rows)
    f_gg = grouped_gemm_flops(problem, n_rows)
    hbm, link = hbm_bytes_forward(problem, n_rows), link_bytes_forward(problem, n_remote)
    m = medians
    rate = {"mok_fwd": {"tflops": tflops(f_fwd, m["mok_fwd"]), "tflops_performed": tflops(perf, m["mok_fwd"])},
            "mok_bwd": {"tflops": tflops(f_bwd, m["mok_bwd"]), "tflops_performed": tflops(2 * perf, m["mok_bwd"])},
            "pipe_fwd": {"tflops": tflops(f_fwd, m["pipe_fwd"]), "tflops_performed": tflops(perf, m["pipe_fwd"])},
            "pipe_bwd": {"tflops": tflops(f_bwd, m["pipe_bwd"]),
                         "tflops_performed": tflops(2 * perf, m["pipe_bwd"])},
            "gg": {"tflops": tflops(f_gg, m["gg"])}}
    mok_gbps, pipe_gbps = gbps(hbm, m["mok_fwd"]), gbps(hbm, m["pipe_fwd"])
    return {
        "flops": {"mok_forward": f_fwd, "mok_backward": f_bwd, "performed_forward": perf, "grouped_gemms": f_gg},
        "mok": {"forward": rate["mok_fwd"], "backward": rate["mok_bwd"]},
        "peers": {"pytorch_pipeline": {"forward": rate["pipe_fwd"], "backward": rate["pipe_bwd"]},
                  "pytorch_grouped_gemms": {"forward": rate["gg"]}},
        "ratios": {
            "speedup_forward_vs_pytorch": ratio(m["pipe_fwd"], m["mok_fwd"]),
            "speedup_backward_vs_pytorch": ratio(m["pipe_bwd"], m["mok_bwd"]),
            "mok_forward_of_dense_ceiling": ratio(rate["mok_fwd"]["tflops"], dense),
            # The FLOPs really done over the ceiling (MoK's count is not the work done without a
            # shared expert, or on a slice whose rank receives other than T*k rows).
            "mok_forward_performed_of_dense_ceiling": ratio(rate["mok_fwd"]["tflops_performed"], dense),
            "mok_backward_of_dense_ceiling": ratio(rate["mok_bwd"]["tflops"], dense),
            "pytorch_forward_of_dense_ceiling": ratio(rate["pipe_fwd"]["tflops"], dense),
            "grouped_gemms_of_dense_ceiling": ratio(rate["gg"]["tflops"], dense),
            "pytorch_pipeline_over_grouped_gemms": ratio(m["pipe_fwd"], m["gg"]),
            "mok_over_grouped_gemms": ratio(m["mok_fwd"], m["gg"]),
        },
        "bytes": {"hbm_forward": hbm, "link_forward": link,
                  "mok_hbm_gbps": mok_gbps, "mok_hbm_of_copy_ceiling": ratio(mok_gbps, copy),
                  "pytorch_hbm_gbps": pipe_gbps, "pytorch_hbm_of_copy_ceiling": ratio(pipe_gbps, copy),
                  "mok_link_gbps": gbps(link, m["mok_fwd"]),
                  # Against NCCL's all-to-all bus bandwidth, one direction: while the rank pulls
                  # its rows in and pushes its results out (link_forward), the other ranks pull
                  # about as many of its rows out and push as many results in, so each direction
                  # of its links carries about link_forward bytes.
                  "mok_link_of_nccl_all_to_all": ratio(gbps(link, m["mok_fwd"]), a2a)},
    }


def peer_pass_of(peer_ran, peer_check, peer_errors, verdict):
    """The peer's verdict: None when no peer ran; False when it ran but has no check or reported
    errors (its check or a timing raised: incomplete, so the record fails rather than showing
    PASS beside missing figures); else its check's `verdict`."""
    return None if not peer_ran else False if peer_check is None or bool(peer_errors) else verdict


def verdicts(mok_pass, peer_pass, peer_ran, run_errors):
    """A record's "check": passing needs mok's check, a peer that ran and passed, and no process
    error. With --no-peer ("peer_ran" false) nothing was measured beside mok: shown as "no
    peer", never PASS. (make_record writes it; verdict_errors holds a loaded record to it.)"""
    return {"mok": mok_pass, "pytorch": peer_pass, "peer_ran": peer_ran,
            "passes": mok_pass is True and peer_pass is True and not run_errors}


def make_record(mok, peer, env, clocks=None, errors=None):
    """One benchmark record from mok.json, peer.json (may be None), collect_env() and the
    clock samples of the run (run.py: {"samples", "gpus", "period_ms", "error"}; may be None).
    `errors`: what went wrong in the run although both JSON files were written (run.py: "mok
    bench exited 3"); the record keeps them and fails, since a process that exited non-zero
    may have written figures it did not finish. A timed entry or ceiling that is not a finite
    number > 0 (timing_errors) is a ValueError naming mok.json or peer.json and the key. A peer
    measured on another GPU than mok, or one that passed its check without a forward timing, adds
    its reason to the errors: the record fails rather than compare what was not measured alike."""
    bad = timing_errors(mok, "mok.json", True) + (timing_errors(peer, "peer.json", False) if peer else [])
    if bad:
        raise ValueError("; ".join(bad))
    problem = mok["problem"]
    rows = mok["rows"]
    n_rows = int(rows["real"])
    n_remote = int(rows.get("remote", 0))
    peer = peer or {}
    penv = peer.get("env") or {}
    mok_check = (mok.get("check") or {}).get("forward")
    peer_check = peer.get("check")

    mok_fwd, mok_bwd = _timed(mok.get("forward")), _timed(mok.get("backward"))
    pipe_fwd, pipe_bwd = _timed(peer.get("forward")), _timed(peer.get("backward"))
    gg = _timed(peer.get("grouped_gemms"))
    ceilings = peer.get("ceilings") or {}
    dense = (ceilings.get("dense_bf16") or {}).get("tflops")
    fp8 = (ceilings.get("fp8_e4m3") or {}).get("tflops")
    fp8_exact = (ceilings.get("fp8_e4m3_exact_accum") or {}).get("tflops")
    copy = (ceilings.get("copy") or {}).get("gbps")
    a2a = (ceilings.get("nccl_all_to_all") or {}).get("busbw_gbps")
    ms = lambda e: e["median_ms"] if e else None  # noqa: E731
    fig = derived_figures(problem, n_rows, n_remote,
                          {"mok_fwd": ms(mok_fwd), "mok_bwd": ms(mok_bwd), "pipe_fwd": ms(pipe_fwd),
                           "pipe_bwd": ms(pipe_bwd), "gg": ms(gg)}, dense, copy, a2a)
    for entry, rates in ((mok_fwd, fig["mok"]["forward"]), (mok_bwd, fig["mok"]["backward"]),
                         (pipe_fwd, fig["peers"]["pytorch_pipeline"]["forward"]),
                         (pipe_bwd, fig["peers"]["pytorch_pipeline"]["backward"]),
                         (gg, fig["peers"]["pytorch_grouped_gemms"]["forward"])):
        if entry:
            entry.update(rates)

    mok_pass = None if mok_check is None else check_passes(mok_check, "mok.json", "check.forward")
    peer_verdict = None if peer_check is None else check_passes(peer_check, "peer.json", "check")
    peer_pass = peer_pass_of(bool(peer), peer_check, peer.get("errors"), peer_verdict)
    errors = [str(e) for e in errors or []]
    commit = env["commit"]
    mgpu = mok.get("gpu") or {}
    if peer:
        # A speedup is a claim about one GPU: mok's and the peer's times from two GPUs (another
        # model, or a device that changed between the two programs) compare nothing.
        why = gpu_mismatch(mgpu.get("name"), penv.get("gpu"), mgpu.get("uuid"), penv.get("uuid"))
        if why:
            errors.append(why)
        if peer_pass is True and not pipe_fwd:
            errors.append(NO_PEER_FORWARD)
    capability = penv.get("capability") or mgpu.get("capability")
    return strict_json({
        "schema": SCHEMA,
        "date": env["date"],
        "commit": {"sha": commit["sha"], "short": commit["sha"][:7] if commit["sha"] != "unknown" else "unknown",
                   "dirty": commit.get("dirty"), "source": commit.get("source")},
        "gpu": {"name": mgpu.get("name"), "uuid": mgpu.get("uuid"), "peer_uuid": penv.get("uuid"),
                "sms": mgpu.get("sms"),
                "driver": mgpu.get("driver"), "cuda_runtime": mgpu.get("cuda_runtime"),
                "torch": penv.get("torch"), "torch_cuda": penv.get("torch_cuda"), "peer_gpu": penv.get("gpu"),
                "capability": capability},
        "shape": mok["shape"],
        "ep_mode": mok["ep_mode"],
        "active_rank": mok.get("active_rank"),
        "tokens_per_rank": int(problem["tokens_per_rank"]),
        "precision": problem["precision"],
        "problem": problem,
        "routing": mok.get("routing"),
        "rows": {"real": n_rows, "remote": n_remote, "padded": rows.get("padded")},
        "config": mok.get("config"),
        "timing": {"mok": mok.get("timing"), "peer": peer.get("timing")},
        "flops": fig["flops"],
        "mok": {"forward": mok_fwd, "backward": mok_bwd, "check": mok_check, "ranks": mok.get("ranks"),
                "forward_phases": forward_phases(mok)},
        "peers": {
            "pytorch_pipeline": {"forward": pipe_fwd, "backward": pipe_bwd, "check": peer_check,
                                 "precision": peer.get("peer_precision"), "what": peer.get("peer"),
                                 "code": peer.get("peer_code"),
                                 "backward_includes": peer.get("backward_includes"),
                                 "skipped": peer.get("skipped"), "errors": peer.get("errors"),
                                 "profile": peer.get("profile")},
            "pytorch_grouped_gemms": {"forward": gg, "gate_up": _timed(peer.get("gate_up_gemm")),
                                      "down": _timed(peer.get("down_gemm"))},
        } if peer else {},
        "ceilings": {"dense_bf16_tflops": dense, "fp8_e4m3_tflops": fp8, "fp8_e4m3_exact_accum_tflops": fp8_exact,
                     "copy_gbps": copy, "nccl_all_to_all_busbw_gbps": a2a,
                     "detail": ceilings or None},
        "ratios": fig["ratios"],
        "bytes": fig["bytes"],
        "clocks": clock_section(mok, peer, clocks, capability, mgpu.get("sms"),
                                (mok_fwd or {}).get("tflops_performed"), dense),
        "errors": errors,
        "check": verdicts(mok_pass, peer_pass, bool(peer), errors),
    })


# ---- reading a record -------------------------------------------------------------------

NO_PEER_FORWARD = "the PyTorch peer passed its check but has no forward timing (peer.json forward.median_ms)"


def uuid_digits(uuid):
    """A GPU UUID's 32 hex digits, lower case, however spelt (nvidia-smi's "GPU-" prefix, with or
    without dashes); None when not a string of exactly that."""
    if not isinstance(uuid, str):
        return None
    text = uuid.strip().lower()
    text = text[len("gpu-"):] if text.startswith("gpu-") else text
    digits = text.replace("-", "")
    return digits if len(digits) == 32 and all(c in "0123456789abcdef" for c in digits) else None


def gpu_mismatch(mok_gpu, peer_gpu, mok_uuid=None, peer_uuid=None):
    """Why a comparison of mok on `mok_gpu` with a peer on `peer_gpu` (their names, as the two
    programs read them) is none, or None when both name one GPU model or either is unknown.
    Where both programs wrote their GPU's UUID, the two must also be one card."""
    if isinstance(mok_gpu, str) and isinstance(peer_gpu, str) and mok_gpu.strip() != peer_gpu.strip():
        return f"the PyTorch peer ran on {peer_gpu.strip()!r}, mok on {mok_gpu.strip()!r}: no comparison across GPUs"
    mine, theirs = uuid_digits(mok_uuid), uuid_digits(peer_uuid)
    if mine and theirs and mine != theirs:
        return (f"the PyTorch peer ran on the GPU {str(peer_uuid).strip()!r}, mok on {str(mok_uuid).strip()!r} "
                f"(two cards of one model): no comparison across GPUs")
    return None


def comparison_errors(rec):
    """Why a record with a peer compares nothing, beyond its check and its errors: the peer ran on
    another GPU than mok (gpu.peer_gpu against gpu.name), or it passed without a forward median.
    [] when neither (or no peer ran). A record made before these were refused, or edited, fails
    by them all the same."""
    if not peer_ran(rec):
        return []
    out = []
    gpu = rec.get("gpu") if isinstance(rec.get("gpu"), dict) else {}
    why = gpu_mismatch(gpu.get("name"), gpu.get("peer_gpu"), gpu.get("uuid"), gpu.get("peer_uuid"))
    if why:
        out.append(why)
    pipe = (rec.get("peers") or {}).get("pytorch_pipeline")
    forward = pipe.get("forward") if isinstance(pipe, dict) else None
    if (rec.get("check") or {}).get("pytorch") is True and not (isinstance(forward, dict)
                                                                 and forward.get("median_ms") is not None):
        out.append(NO_PEER_FORWARD)
    return out


def peer_ran(rec):
    """Whether a peer ran for the record (records before "check.peer_ran": it had peers)."""
    c = rec.get("check") or {}
    return bool(c["peer_ran"]) if "peer_ran" in c else bool(rec.get("peers"))


def record_passes(rec):
    """The record's verdict: its check passed, and so did each part of it (mok's and the peer's
    checks, so that a stored verdict its parts contradict, from an older records.py or an
    edit, is not shown as a pass), the run reported no process error, and the comparison holds
    (comparison_errors: the peer on mok's GPU, with a forward median)."""
    c = rec.get("check") or {}
    return (bool(c.get("passes")) and c.get("mok") is True and c.get("pytorch") is True and not rec.get("errors")
            and not comparison_errors(rec))


def contract_breaks(rec):
    """Why a record is off MoK's timing contract (500 warm-up and 100 timed iterations for mok
    and the peer, the peer measured in the same run, and its ceilings at their 500 warm-up and
    200 timed iterations: shorter runs of the dense GEMM swung by a fifth), read from its
    "timing"; [] when it is on it. A record made otherwise (--no-peer, --warmup 0 --iters 1) must not stand for a
    shape beside the ones made to the contract, however new it is."""
    why = []
    timing = rec.get("timing") or {}
    sides = [("mok", timing.get("mok"))]
    if peer_ran(rec):
        sides.append(("peer", timing.get("peer")))
    else:
        why.append("no peer")
    for who, t in sides:
        if not isinstance(t, dict):
            why.append(f"{who} timing not recorded")
            continue
        if t.get("warmup") != checks.WARMUP:
            why.append(f"{who} warm-up {t.get('warmup')} (contract {checks.WARMUP})")
        if t.get("iters") != checks.ITERS:
            why.append(f"{who} timed iterations {t.get('iters')} (contract {checks.ITERS})")
        if who == "peer" and (t.get("ceiling_warmup"), t.get("ceiling_iters")) != (checks.CEILING_WARMUP,
                                                                                     checks.CEILING_ITERS):
            why.append(f"ceilings at {t.get('ceiling_warmup')} warm-up / {t.get('ceiling_iters')} timed iterations "
                       f"(contract {checks.CEILING_WARMUP} / {checks.CEILING_ITERS})")
    return why


def check_text(rec):
    """The record's verdict in words, for run.py's summary and the report: PASS, "no peer" when
    mok passed but no peer ran (not a pass), else FAIL with what failed."""
    c = rec.get("check") or {}
    errors = list(rec.get("errors") or [])
    if record_passes(rec):
        return "PASS"
    parts = []
    if c.get("mok") is not True:
        parts.append(f"mok {'FAIL' if c.get('mok') is False else 'unchecked'}")
    if not peer_ran(rec):
        parts.append("no peer")
    elif c.get("pytorch") is False:
        parts.append("pytorch FAIL")
    parts += errors
    parts += [why for why in comparison_errors(rec) if why not in errors]
    if parts == ["no peer"]:
        return "no peer (mok PASS)"
    return "FAIL (" + ", ".join(parts) + ")" if parts else "FAIL"


def fmt(v, spec, suffix=""):
    """A number for a table ("–" when unknown; a non-finite one, which records hold as the
    string "inf" or "nan" (strict_json), as it is)."""
    if isinstance(v, str):
        return v
    return "–" if v is None else format(v, spec) + suffix


def pct(fraction):
    """A fraction as a percentage with one decimal ("–" when unknown)."""
    return fmt(None if fraction is None else 100 * fraction, ".1f", "%")


# ---- files ------------------------------------------------------------------------------
# (The work directory's JSON files are read here, not in workdir.py: that file is part of the
# peer's code (checks.PEER_FILES), whose hash the records carry, and the peer's timed code did
# not change with these checks.)

def read_json_named(path):
    """The JSON value in `path`; ValueError naming the file when it is not valid JSON."""
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except ValueError as exc:  # (JSONDecodeError, and text that is not UTF-8)
            raise ValueError(f"{path}: not valid JSON: {exc}") from None


def write_json_atomic(path, value):
    """Writes `value` as JSON to `path` through a temporary file in the same folder (flushed,
    fsynced: workdir.synced_tmp) and os.replace: a reader sees the old file or the whole new one, never
    half of it; the temporary file is removed on any failure."""
    text = json.dumps(value, indent=1)  # (a value JSON cannot hold fails here, before any file)
    tmp = workdir.synced_tmp(os.path.dirname(os.path.abspath(path)), os.path.basename(path), text)
    try:
        os.replace(tmp, path)
    finally:
        _remove_if_there(tmp)
    return path


def load_peer_json(work_dir):
    """DIR/peer.json as a dict; ValueError naming the file when it is not valid JSON, not an
    object, or its check's "passes" is not a real bool (the string "false" would read as true)."""
    path = os.path.join(work_dir, workdir.PEER_JSON)
    doc = read_json_named(path)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: must be a JSON object")
    if doc.get("check") is not None:
        check_passes(doc["check"], path, "check")  # (raises naming the file and the key)
    bad = timing_errors(doc, path, False)  # (a NaN or negative median: no record compares with it)
    if bad:
        raise ValueError("; ".join(bad))
    return doc


def load_mok_json(work_dir):
    """workdir.load_mok_json, with a file that is not valid JSON named, and the check's verdict
    required to be a real bool (bool("false") is True: a verdict that is not true or false must
    never read as PASS; a missing check is allowed, and the record then says FAIL)."""
    path = os.path.join(work_dir, workdir.MOK_JSON)
    if os.path.exists(path):
        try:
            doc = read_json_named(path)
        except ValueError as exc:
            raise workdir.ContractError(str(exc)) from None
        if not isinstance(doc, dict):
            raise workdir.ContractError(f"{path}: must be a JSON object")
    doc = workdir.load_mok_json(work_dir)
    check = doc.get("check")
    # (A check that is not an object is named as its forward verdict's place: check.forward.)
    forward = check.get("forward") if isinstance(check, dict) else check
    if forward is not None:
        try:
            check_passes(forward, path, "check.forward")
        except ValueError as exc:
            raise workdir.ContractError(str(exc)) from None
    bad = timing_errors(doc, path, True)
    if bad:
        raise workdir.ContractError("; ".join(bad))
    return doc


def safe_name(name):
    """`name` as a file-name part: runs of other characters than letters, digits, '.', '_' and
    '-' become one '-' ("unnamed" when nothing is left)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(name)).strip("-") or "unnamed"


def record_basename(record):
    """<UTC date>_<shape>_<epmode>_<short commit> (no suffix, no extension)."""
    day = record["date"][:10]
    return "_".join(safe_name(p) for p in (day, record["shape"], record["ep_mode"], record["commit"]["short"]))


def in_results_dir(path, results_dir=None):
    """Whether `path` (a folder or a file) is the repository's own results folder or lies in it
    (real paths: a link to it counts). `results_dir`: RESULTS_DIR as it is now (tests patch it)."""
    root = os.path.realpath(RESULTS_DIR if results_dir is None else results_dir)
    real = os.path.realpath(path)
    return real == root or os.path.commonpath([real, root]) == root


# A record made from a test fixture (tests/fake_mok.py's "SYNTHETIC-GPU (test fixture)", the
# fixtures' "FIXTURE-GPU") must never stand in bench/results/ beside real measurements.
SYNTHETIC_GPU = re.compile(r"synthetic|fixture", re.IGNORECASE)


def synthetic_gpu_error(record):
    """Why `record`, a valid one (record_errors: its gpu.name is a non-empty string), may not
    stand in the repository's results folder (its GPU is a test fixture's), or None."""
    name = record["gpu"]["name"]
    if SYNTHETIC_GPU.search(name):
        return (f"'gpu.name' {name!r} is a test fixture's GPU: a synthetic record never goes into "
                f"{RESULTS_DIR} (give the tests' runs a --results-dir of their own)")
    return None


def _remove_if_there(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(folder):
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # (some file systems do not sync folders; the file itself was synced)
    finally:
        os.close(fd)


def write_record(record, results_dir=None):
    """Writes results_dir/<basename>.json, or <basename>_2.json, _3, ... : never overwrites, and
    never leaves a half-written record: the JSON goes to a temporary file in the same folder,
    flushed and fsynced, which is then hard-linked to the first free name (os.link fails rather
    than replace a file) and unlinked. results_dir defaults to RESULTS_DIR, where a record must
    name a real GPU (synthetic_gpu_error). The record is validated as load_record would
    (validate_record) first: a ValueError naming the rule, and nothing written."""
    results_dir = RESULTS_DIR if results_dir is None else results_dir
    errors = record_errors(record)
    if errors:
        raise ValueError(f"record not written to {results_dir}: " + "; ".join(errors))
    if in_results_dir(results_dir):
        why = synthetic_gpu_error(record)
        if why:
            raise ValueError(f"record not written to {results_dir}: {why}")
    os.makedirs(results_dir, exist_ok=True)
    text = json.dumps(record, indent=1, sort_keys=False, allow_nan=False) + "\n"
    base = record_basename(record)
    tmp = workdir.synced_tmp(results_dir, base, text)
    try:
        n = 1
        while True:
            path = os.path.join(results_dir, f"{base}.json" if n == 1 else f"{base}_{n}.json")
            try:
                os.link(tmp, path)  # fails if the name is taken: a record is never overwritten
                break
            except FileExistsError:
                n += 1
        _fsync_dir(results_dir)
        return path
    finally:
        _remove_if_there(tmp)


# What the report reads without asking: a file lacking one is not a record (peer.json has the
# same schema number and a "shape", and once passed for one).
REQUIRED = {"shape": str, "ep_mode": str, "tokens_per_rank": int, "precision": str, "problem": dict,
            "date": str, "commit": dict, "check": dict}
DATE_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # what collect_env writes (UTC)
# A device's clock may run a little ahead of the machine that reads its records.
FUTURE_SLACK = datetime.timedelta(minutes=10)


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite_at_least_0(value):
    return _number(value) and math.isfinite(value) and value >= 0


def _timed_errors(entry, key):
    """What is wrong with a timed entry {median_ms, min_ms, max_ms} at `key`, or None."""
    if not isinstance(entry, dict):
        return f"'{key}' must be an object with median_ms (got {json.dumps(entry)[:40]})"
    med = entry.get("median_ms")
    if not _number(med) or not math.isfinite(med) or med <= 0:
        return f"'{key}.median_ms' must be a finite number > 0 (got {json.dumps(med)[:40]})"
    for bound in ("min_ms", "max_ms"):
        v = entry.get(bound)
        if bound in entry and v is not None and (not _number(v) or not math.isfinite(v)):
            return f"'{key}.{bound}' must be a finite number (got {json.dumps(v)[:40]})"
    lo, hi = entry.get("min_ms"), entry.get("max_ms")
    if (lo is not None and lo > med) or (hi is not None and hi < med):
        return f"'{key}' must have min_ms <= median_ms <= max_ms (got {lo}, {med}, {hi})"
    if lo is not None and lo <= 0:  # (a time; 0 would also hide a noisy run from the report)
        return f"'{key}.min_ms' must be > 0 (got {lo})"
    for rate in ("tflops", "tflops_performed"):
        why = _positive_errors(entry.get(rate), f"{key}.{rate}")
        if why:
            return why
    return None


def _positive_errors(value, key):
    """What is wrong with a rate or ceiling at `key` that must be a finite number > 0 or null
    (not measured), or None. (A string "inf" is what strict_json made of a non-finite figure:
    no rate a report may divide by or compare.)"""
    if value is not None and (not _number(value) or not math.isfinite(value) or value <= 0):
        return f"'{key}' must be a finite number > 0 or null (got {json.dumps(value)[:40]})"
    return None


# The timed entries of a record (mok's, each peer's) beyond mok.forward, which is required:
# each one, where not null, is a timed entry (_timed_errors) whose median the report divides by.
MOK_TIMED = ("backward",)
PEER_TIMED = ("forward", "backward", "gate_up", "down")
# The ceilings a record carries (make_record), each a finite number > 0 or null.
CEILING_KEYS = ("dense_bf16_tflops", "fp8_e4m3_tflops", "fp8_e4m3_exact_accum_tflops", "copy_gbps",
                "nccl_all_to_all_busbw_gbps")
# How far a stored rate, ratio or count may be from what the record's medians and problem give:
# JSON keeps a float's digits, so only a record made by another rounding differs at all.
DERIVED_REL_TOL = 1e-6


def timing_errors(doc, source, mok_side):
    """What is wrong with the timed entries and ceilings of a mok.json (`mok_side`) or a peer.json
    `doc` read from `source`: every timed entry given (not null) a finite median > 0 with
    min_ms <= median_ms <= max_ms, every ceiling's rate a finite number > 0 or null. Messages name
    the file and the key. (Checked when a record is made: a NaN or negative median would make a
    record whose speedups and rates mean nothing.)"""
    errors = []
    names = ("forward", "backward") if mok_side else ("forward", "backward", "grouped_gemms", "gate_up_gemm",
                                                      "down_gemm")
    for name in names:
        entry = doc.get(name)
        if entry is not None:
            why = _timed_errors(entry, name)
            if why:
                errors.append(f"{source}: {why}")
    if not mok_side:
        ceilings = doc.get("ceilings")
        if ceilings is not None and not isinstance(ceilings, dict):
            errors.append(f"{source}: 'ceilings' must be an object (got {json.dumps(ceilings)[:40]})")
        for name, rate in (("dense_bf16", "tflops"), ("fp8_e4m3", "tflops"), ("fp8_e4m3_exact_accum", "tflops"),
                           ("copy", "gbps"), ("nccl_all_to_all", "busbw_gbps")):
            entry = (ceilings or {}).get(name) if isinstance(ceilings, dict) else None
            if entry is not None and not isinstance(entry, dict):
                errors.append(f"{source}: 'ceilings.{name}' must be an object (got {json.dumps(entry)[:40]})")
            elif entry is not None:
                why = _positive_errors(entry.get(rate), f"ceilings.{name}.{rate}")
                if why:
                    errors.append(f"{source}: {why}")
    return errors


CLOCK_LOOPS = ("mok_forward", "pytorch_forward", "pytorch_grouped_gemms", "dense_bf16_ceiling")
CLOCK_FIGURES = ("tensor_peak_bf16_tflops_at_mok_clock", "mok_forward_performed_of_tensor_peak",
                 "dense_bf16_of_tensor_peak_at_its_clock", "mok_forward_pj_per_flop", "dense_bf16_pj_per_flop")
LOOP_FIGURES = ("samples", "sm_mhz_median", "power_w_median", "sw_power_cap_share")
ITERATION_FIGURES = ("pairs", "ms_spread", "cycles_spread", "r_ms_vs_clock_period")  # (gpu_clocks.clock_following)


def structure_errors(rec):
    """What is wrong with the parts of a record the report reads as objects, lists, strings or
    numbers, beyond the timings (the report would stop on them, not skip the record): routing,
    config and its env, timing and its two sides, the clocks and their loops, mok_args, errors,
    each peer's code and mok's forward phases. Null (or absent) is allowed where a record made
    without the part has it so."""
    errors = []

    def want(value, kinds, key, words):
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)):
            errors.append(f"'{key}' must be {words} or null (got {json.dumps(value)[:40]})")
            return False
        return value is not None

    def number(value, key):
        if value is not None and (not _number(value) or not math.isfinite(value)):
            errors.append(f"'{key}' must be a finite number or null (got {json.dumps(value)[:40]})")

    if want(rec.get("routing"), dict, "routing", "an object"):
        want(rec["routing"].get("spec"), str, "routing.spec", "a string")
        for key in ("max_over_mean_expert", "max_over_mean_rank"):
            number(rec["routing"].get(key), f"routing.{key}")
    if want(rec.get("config"), dict, "config", "an object"):
        want(rec["config"].get("env"), dict, "config.env", "an object")
    if want(rec.get("timing"), dict, "timing", "an object"):
        for side in ("mok", "peer"):
            want(rec["timing"].get(side), dict, f"timing.{side}", "an object")
    for key in ("gpu.uuid", "gpu.peer_uuid"):
        want(_at(rec, key), str, key, "a string")
    if want(rec.get("mok_args"), list, "mok_args", "a list of strings"):
        if not all(isinstance(a, str) for a in rec["mok_args"]):
            errors.append(f"'mok_args' must be a list of strings (got {json.dumps(rec['mok_args'])[:40]})")
    if want(rec.get("errors"), list, "errors", "a list of strings"):
        if not all(isinstance(e, str) for e in rec["errors"]):
            errors.append(f"'errors' must be a list of strings (got {json.dumps(rec['errors'])[:40]})")
    for peer, entry in (rec.get("peers") or {}).items() if isinstance(rec.get("peers"), dict) else ():
        if isinstance(entry, dict):
            want(entry.get("code"), str, f"peers.{peer}.code", "a string")
    mok = rec.get("mok") if isinstance(rec.get("mok"), dict) else {}
    if want(mok.get("forward_phases"), dict, "mok.forward_phases", "an object"):
        med = mok["forward_phases"].get("median_ms")
        if want(med, dict, "mok.forward_phases.median_ms", "an object"):
            for name, ms in med.items():
                if not _finite_at_least_0(ms):
                    errors.append(f"'mok.forward_phases.median_ms.{name}' must be a finite number >= 0 "
                                  f"(got {json.dumps(ms)[:40]})")
        after = mok["forward_phases"].get("timed_after_ms")
        if after is not None and not _finite_at_least_0(after):
            errors.append(f"'mok.forward_phases.timed_after_ms' must be a finite number >= 0 "
                          f"(got {json.dumps(after)[:40]})")
    # Whole numbers the report prints as such (a 2560.0 would stop it).
    for key in ("rows.real", "rows.remote", "rows.padded", "timing.peer.ceiling_warmup", "timing.peer.ceiling_iters"):
        value = _at(rec, key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            errors.append(f"'{key}' must be a whole number >= 0 or null (got {json.dumps(value)[:40]})")
    rows = rec.get("rows") if isinstance(rec.get("rows"), dict) else {}
    if isinstance(rows.get("real"), int) and isinstance(rows.get("remote"), int) and rows["remote"] > rows["real"]:
        errors.append(f"'rows.remote' ({rows['remote']}) must be at most 'rows.real' ({rows['real']})")
    # The keys the report groups records by must be the problem's own (its FLOPs come from it).
    problem = rec.get("problem") if isinstance(rec.get("problem"), dict) else {}
    for key in ("tokens_per_rank", "precision"):
        if key in problem and rec.get(key) != problem[key]:
            errors.append(f"'{key}' ({json.dumps(rec.get(key))[:40]}) must equal 'problem.{key}' "
                          f"({json.dumps(problem[key])[:40]})")
    errors += verdict_errors(rec)
    clocks = rec.get("clocks")
    if want(clocks, dict, "clocks", "an object"):
        want(clocks.get("error"), str, "clocks.error", "a string")
        for key in CLOCK_FIGURES:
            number(clocks.get(key), f"clocks.{key}")
        for loop in CLOCK_LOOPS:
            if want(clocks.get(loop), dict, f"clocks.{loop}", "an object"):
                for key in LOOP_FIGURES:
                    number(clocks[loop].get(key), f"clocks.{loop}.{key}")
                if want(clocks[loop].get("iterations"), dict, f"clocks.{loop}.iterations", "an object"):
                    for key in ITERATION_FIGURES:
                        number(clocks[loop]["iterations"].get(key), f"clocks.{loop}.iterations.{key}")
    return errors


def _at(tree, key):
    """tree's value at the dotted `key`, or None where a part is missing or not an object."""
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def verdict_errors(rec):
    """What the record's summary verdicts (check.mok, check.pytorch, check.peer_ran,
    check.passes) say against the checks they come from (mok.check, the peer's check and
    errors, the run's errors), as make_record derives them: an edited flag must never show a
    failed check as PASS. A key the record lacks (an older records.py) is not asked for."""
    check = rec.get("check") if isinstance(rec.get("check"), dict) else {}
    mok = rec.get("mok") if isinstance(rec.get("mok"), dict) else {}
    peers = rec.get("peers") if isinstance(rec.get("peers"), dict) else {}
    pipe = peers.get("pytorch_pipeline") if peers else {}

    def passes(c):
        return None if c is None else isinstance(c, dict) and c.get("passes") is True

    mok_pass = passes(mok.get("check"))
    if isinstance(pipe, dict):
        peer_check = pipe.get("check") if peers else None
        want = verdicts(mok_pass, peer_pass_of(bool(peers), peer_check, pipe.get("errors"), passes(peer_check)),
                        bool(peers), rec.get("errors"))
    else:  # (no peer's parts to judge the peer's flags by)
        want = {"mok": mok_pass}
    # (A flag that is no bool or null has its own error, from record_errors.)
    return [f"'check.{key}' is {json.dumps(check[key])}, but its parts give {json.dumps(value)}"
            for key, value in want.items()
            if key in check and (check[key] is None or isinstance(check[key], bool)) and check[key] != value]


def _close(stored, expected):
    """Whether a stored figure is the one worked out (both null, or within DERIVED_REL_TOL)."""
    if stored is None or expected is None:
        return stored is None and expected is None
    if not _number(stored) or not math.isfinite(stored):
        return False
    return abs(stored - expected) <= DERIVED_REL_TOL * max(abs(stored), abs(expected))


def derived_errors(rec):
    """What the record stores that its own medians, ceilings, problem and rows contradict: the
    FLOP and byte counts, every timed entry's TFLOP/s, the ratios and the byte rates, each worked
    out again by make_record's own arithmetic (derived_figures) and compared (DERIVED_REL_TOL). A
    figure the record lacks (an older records.py did not store it) is not asked for; one it
    holds must agree: a ratio edited by hand (a speedup of 50x beside medians that give 1.2x)
    must never be shown. Call on a record whose timed entries and ceilings are valid."""
    mok, peers = rec.get("mok") or {}, rec.get("peers") or {}
    pipe, gg = peers.get("pytorch_pipeline") or {}, peers.get("pytorch_grouped_gemms") or {}
    ceilings = rec.get("ceilings") or {}
    ms = lambda e: e.get("median_ms") if isinstance(e, dict) else None  # noqa: E731
    medians = {"mok_fwd": ms(mok.get("forward")), "mok_bwd": ms(mok.get("backward")),
               "pipe_fwd": ms(pipe.get("forward")), "pipe_bwd": ms(pipe.get("backward")), "gg": ms(gg.get("forward"))}
    try:
        rows = rec.get("rows")
        fig = derived_figures(rec["problem"], int(rows["real"]), int(rows.get("remote", 0)), medians,
                              *(ceilings.get(k) for k in ("dense_bf16_tflops", "copy_gbps",
                                                          "nccl_all_to_all_busbw_gbps")))
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
        return [f"'problem' and 'rows' must give the FLOP and byte counts (num_experts, hidden, intermediate, "
                f"top_k, ep_size, tokens_per_rank, shared_intermediate; rows.real, rows.remote as whole "
                f"numbers): {type(exc).__name__}: {exc}"]

    def leaves(tree, path=()):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from leaves(value, path + (key,))
            else:
                yield path + (key,), value

    errors = []
    for path, want in leaves(fig):
        parent = rec
        for part in path[:-1]:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if parent is not None and not isinstance(parent, dict):
            errors.append(f"'{'.'.join(path[:-1])}' must be an object (got {json.dumps(parent)[:40]})")
            continue
        if parent is None or path[-1] not in parent:
            continue  # (not stored: an older record; the report works it out or shows "–")
        if not _close(parent[path[-1]], want):
            errors.append(f"'{'.'.join(path)}' is {json.dumps(parent[path[-1]])[:40]}, but the record's medians, "
                          f"ceilings and problem give {want if want is None else format(want, '.6g')}")
    return errors


def record_errors(rec, now=None):
    """What makes `rec` (a loaded JSON value) not a mok benchmark record of this schema, as
    messages naming the key and the rule; [] when it is one. Beyond the keys the report reads
    (REQUIRED): gpu.name a non-empty string, commit.sha 7 to 40 lower-case hex digits or
    "unknown", check.passes and check.peer_ran real bools and check.mok and check.pytorch bools
    or null (null: not checked, no peer), mok.forward's median_ms and every other timed entry's
    (mok.backward, each peer's forward, backward, gate_up and down) where not null finite and > 0
    with 0 < min_ms <= median_ms <= max_ms, their tflops and every ceiling finite and > 0 or null,
    the verdicts what their parts give (verdict_errors), the keys the report groups by the
    problem's and the row and iteration counts whole numbers (structure_errors),
    the stored FLOP and byte counts, rates and ratios what the medians give (derived_errors), and
    date an ISO-8601 UTC time (YYYY-MM-DDTHH:MM:SSZ) not in the future."""
    if not isinstance(rec, dict) or rec.get("schema") != SCHEMA:
        return [f"not a mok benchmark record (schema {SCHEMA})"]
    words = {str: "a string", int: "a whole number", dict: "an object"}
    for key, kind in REQUIRED.items():
        if not isinstance(rec.get(key), kind) or isinstance(rec.get(key), bool):
            got = "missing" if key not in rec else json.dumps(rec[key])[:40]
            return [f"not a mok benchmark record: '{key}' must be {words[kind]} ({got})"]
    for key in ("sha", "short"):
        if not isinstance(rec["commit"].get(key), str):
            return [f"not a mok benchmark record: 'commit.{key}' must be a string"]
    errors = []
    gpu = rec.get("gpu")
    name = gpu.get("name") if isinstance(gpu, dict) else None
    if not isinstance(name, str) or not name.strip():
        errors.append(f"'gpu.name' must be a non-empty string (got {json.dumps(name)[:40]})")
    sha = rec["commit"]["sha"]
    if not re.fullmatch(r"[0-9a-f]{7,40}", sha) and sha != "unknown":
        errors.append(f"'commit.sha' must be 7 to 40 lower-case hex digits or \"unknown\" (got {sha[:50]!r})")
    check = rec["check"]
    for key, nullable in (("passes", False), ("peer_ran", False), ("mok", True), ("pytorch", True)):
        if key in check and not isinstance(check[key], bool) and not (nullable and check[key] is None):
            errors.append(f"'check.{key}' must be true or false{' (or null)' if nullable else ''} "
                          f"(got {json.dumps(check[key])[:40]})")
    mok = rec.get("mok")
    why = _timed_errors(mok.get("forward") if isinstance(mok, dict) else None, "mok.forward")
    if why:
        errors.append(why)
    for name in MOK_TIMED:
        entry = mok.get(name) if isinstance(mok, dict) else None
        why = None if entry is None else _timed_errors(entry, f"mok.{name}")
        if why:
            errors.append(why)
    peers = rec.get("peers")
    if peers is not None and not isinstance(peers, dict):
        errors.append("'peers' must be an object")
    for peer, entry in sorted((peers or {}).items() if isinstance(peers, dict) else []):
        if entry is not None and not isinstance(entry, dict):
            errors.append(f"'peers.{peer}' must be an object (got {json.dumps(entry)[:40]})")
            continue
        for name in PEER_TIMED:
            timed = (entry or {}).get(name)
            why = None if timed is None else _timed_errors(timed, f"peers.{peer}.{name}")
            if why:
                errors.append(why)
    ceilings = rec.get("ceilings")
    if ceilings is not None and not isinstance(ceilings, dict):
        errors.append(f"'ceilings' must be an object (got {json.dumps(ceilings)[:40]})")
    for key in CEILING_KEYS if isinstance(ceilings, dict) else ():
        why = _positive_errors(ceilings.get(key), f"ceilings.{key}")
        if why:
            errors.append(why)
    errors += structure_errors(rec)
    if not errors:  # (worked out from valid medians and ceilings only)
        errors += derived_errors(rec)
    date = rec["date"]
    try:
        when = datetime.datetime.strptime(date, DATE_FORMAT).replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        errors.append(f"'date' must be an ISO-8601 UTC time like 2026-12-02T15:30:00Z (got {date[:40]!r})")
    else:
        now = now or datetime.datetime.now(datetime.timezone.utc)
        if when > now + FUTURE_SLACK:
            errors.append(f"'date' {date} is in the future (now {now.strftime(DATE_FORMAT)})")
    return errors


def validate_record(rec, where):
    """ValueError naming `where` (the file) and every broken rule (record_errors)."""
    errors = record_errors(rec)
    if errors:
        raise ValueError(f"{where}: " + "; ".join(errors))


def load_record(path):
    """A record file's content; ValueError naming the file and what is missing or wrong when it
    is not a mok benchmark record of this schema (record_errors), is not valid JSON, or is a
    test fixture's record in the repository's results folder (synthetic_gpu_error)."""
    rec = read_json_named(path)
    validate_record(rec, path)
    if in_results_dir(os.path.dirname(os.path.abspath(path))):
        why = synthetic_gpu_error(rec)
        if why:
            raise ValueError(f"{path}: refused: {why}")
    return rec


def already_there(record, results_dir=None):
    """The file in `results_dir` (default RESULTS_DIR) that holds this very record (its name, or
    a _N of it, with the same content), or None."""
    results_dir = RESULTS_DIR if results_dir is None else results_dir
    base = os.path.join(results_dir, record_basename(record))
    for path in [base + ".json"] + sorted(glob.glob(glob.escape(base) + "_*.json")):
        try:
            with open(path) as f:
                if json.load(f) == record:
                    return path
        except (OSError, ValueError):
            continue
    return None


def import_record(record, results_dir=None):
    """Copies a record made elsewhere (a device run's $OUT) into `results_dir` through
    write_record, so a name already taken (the same day, shape, mode and commit, from another
    run) gets _2, _3, ... and no record is overwritten; one already there with the same content
    is not copied again (it would read as a repeat run). Returns (path, copied)."""
    results_dir = RESULTS_DIR if results_dir is None else results_dir
    there = already_there(record, results_dir)
    return (there, False) if there else (write_record(record, results_dir), True)


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description="bench/records.py import FILE.json ...: copies records made "
                                             "elsewhere into bench/results/, never overwriting one")
    ap.add_argument("command", choices=["import"])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--results-dir", default=RESULTS_DIR)
    args = ap.parse_args(argv)
    try:
        loaded = [load_record(p) for p in args.files]
    except (OSError, ValueError) as exc:
        print(f"records.py: {exc}; nothing was imported", file=sys.stderr)
        return 1
    if in_results_dir(args.results_dir):  # (a fixture's record never goes in, nor the others beside it)
        for source, rec in zip(args.files, loaded):
            why = synthetic_gpu_error(rec)
            if why:
                print(f"records.py: {source}: {why}; nothing was imported", file=sys.stderr)
                return 1
    for source, rec in zip(args.files, loaded):  # (every file checked first: all or nothing on a bad one)
        try:
            path, copied = import_record(rec, args.results_dir)
            print(f"{source} -> {path}" if copied else f"{source}: already there as {path}")
        except (OSError, ValueError) as exc:
            print(f"records.py: {source}: {exc}; the files above were imported, this one and those after not",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
