#!/usr/bin/env python3
"""Regenerates bench/REPORT.md and the plots under bench/plots/ from the benchmark records.

    python3 bench/report.py                 # every record in bench/results/
    python3 bench/report.py FILE.json ...   # only these records

Runs anywhere (no GPU, no torch): matplotlib with the Agg backend. When several records
share (shape, EP mode and size, routing, tokens per rank, precision, GPU, variant), the newest
against today's peer wins (by its "date", then by file name), else the newest, among the
records made to MoK's timing contract only (500 warm-up and 100 timed iterations for mok and
the peer, the peer measured in the same run, its ceilings at 500 / 200); the others are
listed in an "Off-contract records" table and nowhere else.
"""
import argparse
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checks  # noqa: E402
import records  # noqa: E402
from records import fmt, pct  # noqa: E402
import run  # noqa: E402  (DEFAULT_RUNS; imports no torch)

BENCH_DIR = records.BENCH_DIR
DEFAULT_OUT = os.path.join(BENCH_DIR, "REPORT.md")
DEFAULT_PLOTS = os.path.join(BENCH_DIR, "plots")

# The order of shapes in tables and plots: run.py's default runs first, then by name.
SHAPE_ORDER = [shape for shape, _, _, _ in run.DEFAULT_RUNS]
DEFAULT_TOKENS = {shape: tokens for shape, _, _, tokens in run.DEFAULT_RUNS}
PLOT_FILES = ("tflops_per_shape.png", "dense_ceiling_fraction.png", "forward_phases.png")


# ---- selecting records ------------------------------------------------------------------

def routing_spec(rec):
    return (rec.get("routing") or {}).get("spec", "?")


def record_key(rec):
    """What makes two records measurements of the same thing: shape, EP mode and size, routing,
    tokens, precision and GPU (a slice of EP 8 is not one of EP 64; an H100 is not an H200)."""
    return (rec["shape"], rec["ep_mode"], int((rec.get("problem") or {}).get("ep_size") or 0), routing_spec(rec),
            int(rec["tokens_per_rank"]), rec["precision"], (rec.get("gpu") or {}).get("name") or "?")


def series_key(rec):
    """record_key without the tokens: one line of a sweep, one bar group."""
    shape, mode, ep, routing, _, precision, gpu = record_key(rec)
    return (shape, mode, ep, routing, precision, gpu)


def _shape_rank(shape):
    return (SHAPE_ORDER.index(shape), "") if shape in SHAPE_ORDER else (len(SHAPE_ORDER), shape)


def sort_key(rec):
    shape, mode, ep, routing, tokens, precision, gpu = record_key(rec)
    return (_shape_rank(shape), mode, ep, routing, precision, gpu, tokens)


def load_records(paths, skipped=None):
    """(path, record) for each readable record; unreadable files are reported on stderr and
    skipped, and appended to `skipped` (a list, when given) as (path, why) for REPORT.md."""
    out = []
    for p in paths:
        try:
            out.append((p, records.load_record(p)))
        except (OSError, ValueError) as exc:
            print(f"report.py: skipping {p}: {exc}", file=sys.stderr)
            if skipped is not None:
                skipped.append((p, str(exc)))
    return out


def skipped_lines(skipped, out_dir):
    """The files given to the report that it could not read as records, each with why (also
    printed on stderr): a skipped file is listed, never silently dropped."""
    if not skipped:
        return []
    lines = ["## Skipped files", "",
             "Files given to the report that are not readable mok benchmark records (bench/records.py, "
             "`load_record`): left out of every table and plot.", "",
             "| file | why |", "|---|---|"]
    for path, why in skipped:
        # (The reason names the file first: shown once, relative to the report.)
        shown = os.path.relpath(os.path.abspath(path), out_dir).replace(os.sep, "/")
        if why.startswith(f"{path}: "):
            why = why[len(path) + 2:]
        lines.append("| " + " | ".join(_cell(c) for c in (shown, why.replace("\n", " "))) + " |")
    return lines + [""]


def split_contract(loaded):
    """(on, off): the (path, record) pairs made to MoK's timing contract, and the others
    (records.contract_breaks). Only the first stand for a shape in the main table, the plots,
    the sweeps and the repeat table: a newer --no-peer or --iters 1 record must not replace a
    contract one there."""
    on, off = [], []
    for path, rec in loaded:
        (off if records.contract_breaks(rec) else on).append((path, rec))
    return on, off


def off_contract_lines(off):
    """The off-contract records, one row per key and reason (the newest, and how many)."""
    if not off:
        return []
    groups = {}
    for path, rec in off:
        why = "; ".join(records.contract_breaks(rec))
        groups.setdefault(record_key(rec) + (why,), []).append((path, rec))
    lines = ["## Off-contract records", "",
             f"Records not made to MoK's timing contract ({checks.WARMUP} warm-up and "
             f"{checks.ITERS} timed iterations for mok and the PyTorch peer, its ceilings at "
             f"{checks.CEILING_WARMUP} / {checks.CEILING_ITERS}, the peer measured in the "
             "same run): left out of every other table and plot, however new. One row per shape, EP mode, "
             "routing, tokens and reason: the newest record and how many there are.", "",
             "| shape | EP mode | routing | tokens | mok ms | PyTorch ms | check | commit | newest | records "
             "| off-contract because |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(groups, key=lambda k: sort_key(groups[k][0][1]) + (k[-1],)):
        rec = newest_per_key(groups[key])[0]
        v = values(rec)
        cells = [rec["shape"], ep_text(rec), routing_spec(rec), rec["tokens_per_rank"], fmt(v["mok_ms"], ".3f"),
                 fmt(v["pt_ms"], ".3f"), records.check_text(rec), commit_text(rec), rec.get("date", "?")[:10],
                 len(groups[key]), key[-1]]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines + [""]


@functools.lru_cache(maxsize=None)
def _checkout_peer_code(tool):
    return checks.peer_code(tool)  # (read once per report: the files do not change meanwhile)


def current_peer_code(rec):
    """The code id (checks.peer_code) of the peer in this checkout that `rec`'s kind of run uses."""
    return _checkout_peer_code("peer_dist" if rec.get("ep_mode") == "distributed" else "peer_torch")


def peer_code_of(rec):
    """The code id of the peer `rec` was measured against (None: not recorded, older records)."""
    return ((rec.get("peers") or {}).get("pytorch_pipeline") or {}).get("code")


def todays_peer(rec):
    return peer_code_of(rec) is not None and peer_code_of(rec) == current_peer_code(rec)


def peer_text(rec):
    """"today's", or the earlier peer's code id ("unrecorded" before records kept one)."""
    if todays_peer(rec):
        return "today's"
    code = peer_code_of(rec)
    return ("earlier: " + code.split(":")[-1]) if code else "earlier (unrecorded)"


def newest_per_key(loaded):
    """The newest record of each (shape, EP mode, routing, tokens, precision), sorted for display:
    one measured against today's peer when there is one (a newer record against an earlier peer,
    or none at all recorded, does not stand for the shape beside today's)."""
    best = {}
    for path, rec in loaded:
        key = record_key(rec) + variant_of(rec)
        rank = (todays_peer(rec), rec.get("date", ""), os.path.basename(path))
        if key not in best or rank > best[key][0]:
            best[key] = (rank, rec)
    return sorted((rec for _, rec in best.values()), key=sort_key)


def bar_records(recs):
    """One record per (shape, EP mode, routing, precision) for the per-shape plots: the one at
    the shape's default tokens per rank if present, else the one with the most tokens. Failed
    records are left out: a bar has no FAIL beside it (the tables have); so are variants
    (variant_of: they did not time the defaults)."""
    groups = {}
    for rec in recs:
        if records.record_passes(rec) and not variant_of(rec):
            groups.setdefault(series_key(rec), []).append(rec)
    chosen = []
    for (shape, *_), group in groups.items():
        at_default = [r for r in group if int(r["tokens_per_rank"]) == DEFAULT_TOKENS.get(shape)]
        chosen.append(at_default[0] if at_default else max(group, key=lambda r: int(r["tokens_per_rank"])))
    return sorted(chosen, key=sort_key)


def commit_label(rec, digits=None):
    """The record's commit (its short name, or the sha's first `digits`) with '+dirty' for a
    modified tree and '+dirty?' when nobody could say (dirty null: MOK_BENCH_COMMIT without
    MOK_BENCH_DIRTY, git status failing): unknown is never shown as clean."""
    c = rec.get("commit") or {}
    sha = str(c.get("sha", "?"))
    name = str(c.get("short") or sha[:7]) if digits is None else sha[:digits]
    return name + {True: "+dirty", False: ""}.get(c.get("dirty"), "+dirty?")


def mok_args_of(rec):
    """The options run.py passed to mok bench beyond its own (--mok-arg), as a tuple."""
    return tuple(rec.get("mok_args") or ())


# config.env entries that bound waits and change no kernel: a run that set them timed the default.
WAIT_LIMIT_KNOBS = frozenset({"MOK_WAIT_TIMEOUT_MS", "MOK_GROUP_START_TIMEOUT_MS"})


def variant_of(rec):
    """What the run changed from the commit's defaults: the megakernel's environment knobs
    (config.env, "MOK_X=1"; wait limits aside) and the extra mok bench options; () for a
    default run. A variant stands beside the default record of its key, never for it, and is
    left out of the plots."""
    knobs = ((rec.get("config") or {}).get("env")) or {}
    return tuple(f"{k}={v}" for k, v in sorted(knobs.items()) if k not in WAIT_LIMIT_KNOBS) + mok_args_of(rec)


def commit_text(rec):
    """The commit (commit_label), the megakernel's environment knobs the run set (config.env: a
    record made with MOK_X=1 did not time the commit's default) and the extra mok bench options."""
    return " ".join([commit_label(rec)] + list(variant_of(rec)))


def gpu_short(rec):
    """The record's GPU in a word ("NVIDIA H100 80GB HBM3" -> "H100"; "?" when unrecorded)."""
    name = str((rec.get("gpu") or {}).get("name") or "?")
    name = name[len("NVIDIA "):] if name.startswith("NVIDIA ") else name
    return name.split()[0] if name.split() else "?"


def run_text(rec):
    """Which run a row of the secondary tables comes from: commit (with variant) and GPU, so
    that two records of one shape (an H100's and an H200's, say) are told apart."""
    return f"{commit_text(rec)}, {gpu_short(rec)}"


def _commit_of(rec):
    """What tells two binaries apart in sweeps and repeats: 12 digits of the sha, and dirty."""
    return commit_label(rec, 12)


def sweep_groups(loaded):
    """{series_key: records sorted by tokens} where >= 2 token counts exist, every point from
    ONE commit (the one that measured the most token counts; ties: the newest), so a line never
    joins two binaries; per token count that commit's newest record. Only passing records are
    plotted (a failed one has no FAIL beside it on a line); give contract records only."""
    by_series = {}
    for path, rec in loaded:
        if records.record_passes(rec) and not variant_of(rec):  # (plots time the defaults only)
            by_series.setdefault(series_key(rec), []).append((path, rec))
    out = {}
    for key, items in by_series.items():
        by_commit = {}  # (and the peer: a line never joins two peers either)
        for path, rec in items:
            by_commit.setdefault((_commit_of(rec), peer_code_of(rec)), []).append((path, rec))
        def coverage(entries):
            return (len({int(r["tokens_per_rank"]) for _, r in entries}), max(r.get("date", "") for _, r in entries))
        # Today's peer first: a sweep against an earlier, slower peer stands only where none
        # against today's exists (and its title says so).
        best = newest_per_key(max(by_commit.values(),
                                  key=lambda e: (coverage(e)[0] >= 2, all(todays_peer(r) for _, r in e)) + coverage(e)))
        if len(best) >= 2:
            out[key] = sorted(best, key=lambda r: int(r["tokens_per_rank"]))
    return out


def group_lines(recs):
    """Real EP groups (mok launch): the NVLink side of each record."""
    groups = [r for r in recs if r.get("ep_mode") == "distributed"]
    if not groups:
        return []
    lines = ["## Real EP groups (one process per GPU, NVLink)", "",
             "Per iteration the slowest rank; link bytes = rows each rank pulls from and pushes to the "
             "others (the busiest rank); the ceiling is NCCL's all-to-all bus bandwidth measured in the "
             "same run (one direction: the other ranks move about as many bytes to and from it at the same "
             "time).", "",
             "| shape | ranks | tokens | mok ms | PyTorch + NCCL ms | speedup | link MB/rank | mok link GB/s "
             "| NCCL all-to-all busbw GB/s | of ceiling | check |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for rec in groups:
        v = values(rec)
        b = rec.get("bytes") or {}
        frac = b.get("mok_link_of_nccl_all_to_all")
        cells = [rec["shape"], rec["problem"].get("ep_size"), rec["tokens_per_rank"], fmt(v["mok_ms"], ".3f"),
                 fmt(v["pt_ms"], ".3f"), fmt(v["speedup"], ".2f", "x"),
                 fmt(None if b.get("link_forward") is None else b["link_forward"] / 1e6, ".1f"),
                 fmt(b.get("mok_link_gbps"), ".0f"),
                 fmt((rec.get("ceilings") or {}).get("nccl_all_to_all_busbw_gbps"), ".0f"),
                 pct(frac), records.check_text(rec)]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines + [""]


# What makes two record files one run, for the repeat table: the same date (to the second),
# the same commit (sha and dirty) and the same measured figures, every timed entry's median,
# min and max and the ceilings. A record copied or imported under a second name (content
# equal, or written out again with other formatting) is one run, not two: counted twice it
# would show a spread of 0% that no second measurement made. Two real runs never share all of
# these (a run takes more than a second, and its timings are not reproduced to the last digit).
RUN_TIMINGS = (("mok", "forward"), ("mok", "backward"), ("peers", "pytorch_pipeline", "forward"),
               ("peers", "pytorch_pipeline", "backward"), ("peers", "pytorch_grouped_gemms", "forward"))


def run_identity(rec):
    """The run a record holds (RUN_TIMINGS' comment): equal for copies of one record."""
    commit = rec.get("commit") or {}
    timed = tuple(tuple(_get(rec, *path, k) for k in ("median_ms", "min_ms", "max_ms")) for path in RUN_TIMINGS)
    ceilings = tuple(sorted((k, v) for k, v in (rec.get("ceilings") or {}).items() if k != "detail"))
    return (rec.get("date"), commit.get("sha"), commit.get("dirty"), record_key(rec), timed,
            json.dumps(ceilings, sort_keys=True))


def duplicate_runs(loaded):
    """[(i, path, path of the first file holding the same run)] for each entry i = (path, record)
    of `loaded` whose run (run_identity) an earlier entry holds already (by place, so that one
    file given twice is one run too)."""
    first, out = {}, []
    for i, (path, rec) in enumerate(loaded):
        ident = run_identity(rec)
        if ident in first:
            out.append((i, path, first[ident]))
        else:
            first[ident] = path
    return out


def clean_build(rec):
    """Whether the record timed a known commit's own code: a known sha and a tree recorded as
    clean. A modified tree's build ("+dirty") is not the commit, and two of them need not be the
    same code (another edit, another binary); nor need builds whose state nobody recorded
    ("+dirty?") or of no known commit ("unknown"). They are no measure of one binary's
    run-to-run agreement, so the repeat table leaves them out (the other tables do not)."""
    commit = rec.get("commit") or {}
    return commit.get("dirty") is False and commit.get("sha") not in (None, "", "unknown")


def repeat_groups(loaded):
    """{key + (commit,): records} where one commit was measured more than once on one key: the
    runs whose agreement says how far a single figure can be trusted (passing runs of clean
    builds only, clean_build; each run once, however many files hold it: duplicate_runs)."""
    groups = {}
    copies = {i for i, _, _ in duplicate_runs(loaded)}  # (entries holding a run an earlier one holds)
    for i, (_, rec) in enumerate(loaded):
        if not records.record_passes(rec):  # (a failed run's figures are no measure of agreement)
            continue
        if not clean_build(rec) or i in copies:
            continue
        config = json.dumps(rec.get("config"), sort_keys=True)  # a different --mok-arg is not a repeat
        groups.setdefault(record_key(rec) + (_commit_of(rec), config, mok_args_of(rec), str(peer_code_of(rec))),
                          []).append(rec)
    return {k: sorted(v, key=lambda r: r.get("date", "")) for k, v in groups.items() if len(v) >= 2}


def spread(vals):
    """(max - min) / min of the positive values, or None with fewer than two."""
    vals = [v for v in vals if v is not None and v > 0]
    return (max(vals) - min(vals)) / min(vals) if len(vals) >= 2 else None


def cards_text(recs):
    """How many GPUs (by UUID, gpu.uuid) the runs took: one card's runs measure run-to-run
    agreement, several cards' also the spread between cards of one model. "?" for runs whose
    record predates the UUID."""
    known = {records.uuid_digits((r.get("gpu") or {}).get("uuid")) for r in recs}
    unknown = None in known
    known.discard(None)
    if not known:
        return "?"
    return f"{len(known)} + ?" if unknown else str(len(known))


def repeat_lines(loaded):
    groups = repeat_groups(loaded)
    lines = ["## Repeat runs", ""]
    if not groups:
        return lines + ["No shape has been measured twice at one commit yet (builds of a clean tree only: "
                        "`+dirty` and `+dirty?` builds are left out of this table).", ""]
    lines += ["Medians of every passing run of one commit on one shape; spread = (max - min) / min "
              "(the suite's bar for agreement is 10%). Builds of a clean tree only: a build of a modified tree "
              "(`+dirty`), one whose tree's state was not recorded (`+dirty?`) or of an unknown commit is not "
              "the commit's code, and two of them need not be the same code, so they are left out here (not from "
              "the other tables). Files holding one run (the same date, commit and timings: a record "
              "copied under a second name) count once. cards: how many GPUs the runs took, by UUID (\"?\": "
              "records from before the UUID was kept); runs on several cards spread by the cards too.", "",
              "| shape | EP mode | tokens | commit | runs | mok ms | mok spread | PyTorch ms | PyTorch spread "
              "| dense bf16 TFLOP/s | ceiling spread | cards |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(groups, key=lambda k: (_shape_rank(k[0]),) + tuple(str(x) for x in k[1:])):
        recs = groups[key]
        mok = [values(r)["mok_ms"] for r in recs]
        pt = [values(r)["pt_ms"] for r in recs]
        dense = [values(r)["dense"] for r in recs]
        sm, sp, sd = spread(mok), spread(pt), spread(dense)
        shape, _, _, _, tokens, _, _, commit, _, _, _ = key
        cells = [shape, ep_text(recs[0]), tokens, commit, len(recs), " / ".join(fmt(v, ".3f") for v in mok),
                 pct(sm), " / ".join(fmt(v, ".3f") for v in pt),
                 pct(sp), " / ".join(fmt(v, ".0f") for v in dense),
                 pct(sd), cards_text(recs)]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines + [""]


NOISE_BAR = 1.05  # a median this far above the fastest timed iteration is worth a rerun


def noise_lines(recs):
    """The shown records whose mok or PyTorch-pipeline forward median sits more than 5% above
    its fastest timed iteration: the clock or another process changed during the timing (a
    steady run's median is within 1-3% of its minimum), so the figure deserves a rerun."""
    lines = ["## Noisy timings", ""]
    rows = []
    for rec in recs:
        for who, path in (("mok", ("mok", "forward")), ("PyTorch", ("peers", "pytorch_pipeline", "forward"))):
            median, fastest = _get(rec, *path, "median_ms"), _get(rec, *path, "min_ms")
            ratio = records.ratio(median, fastest)
            if ratio is not None and ratio > NOISE_BAR:
                rows.append([rec["shape"], ep_text(rec), routing_spec(rec), rec["tokens_per_rank"], commit_text(rec),
                             who, fmt(median, ".3f"), fmt(fastest, ".3f"), fmt(_get(rec, *path, "max_ms"), ".3f"),
                             fmt(ratio, ".3f")])
    if not rows:
        return lines + [f"Every shown median is within {NOISE_BAR - 1:.0%} of its fastest timed iteration.", ""]
    lines += [f"Shown records whose forward median is more than {NOISE_BAR - 1:.0%} above the fastest timed "
              "iteration (a steady run's is within 1-3%): the clock or another process changed while they "
              "were timed, so a rerun decides.", "",
              "| shape | EP mode | routing | tokens | commit | timed | median ms | min ms | max ms | median / min |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


# ---- values -----------------------------------------------------------------------------

def _get(rec, *path):
    cur = rec
    for p in path:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(p)
    return cur


def values(rec):
    pipe = ("peers", "pytorch_pipeline")
    pt_tflops_performed = _performed_tflops(rec, 1, (*pipe, "forward"))
    return {
        "mok_ms": _get(rec, "mok", "forward", "median_ms"),
        "mok_tflops": _get(rec, "mok", "forward", "tflops"),
        "mok_tflops_performed": _get(rec, "mok", "forward", "tflops_performed"),
        "mok_bwd_ms": _get(rec, "mok", "backward", "median_ms"),
        "mok_bwd_tflops": _get(rec, "mok", "backward", "tflops"),
        "pt_ms": _get(rec, *pipe, "forward", "median_ms"),
        "pt_tflops": _get(rec, *pipe, "forward", "tflops"),
        "pt_bwd_ms": _get(rec, *pipe, "backward", "median_ms"),
        "pt_bwd_tflops": _get(rec, *pipe, "backward", "tflops"),
        "gg_ms": _get(rec, "peers", "pytorch_grouped_gemms", "forward", "median_ms"),
        "gg_tflops": _get(rec, "peers", "pytorch_grouped_gemms", "forward", "tflops"),
        "speedup": _get(rec, "ratios", "speedup_forward_vs_pytorch"),
        "mok_frac": _get(rec, "ratios", "mok_forward_of_dense_ceiling"),
        "pt_frac": _get(rec, "ratios", "pytorch_forward_of_dense_ceiling"),
        "gg_frac": _get(rec, "ratios", "grouped_gemms_of_dense_ceiling"),
        "dense": _get(rec, "ceilings", "dense_bf16_tflops"),
        # The FLOPs really done over the ceiling: MoK's formula counts T shared-expert rows that
        # shapes without a shared expert do not have, which puts them above 100%. (Worked out
        # from the record's parts: records before 50b8cec lack the stored ratio.)
        "mok_frac_performed": records.ratio(_get(rec, "mok", "forward", "tflops_performed"),
                                            _get(rec, "ceilings", "dense_bf16_tflops")),
        "speedup_at_ceiling": speedup_at_ceiling(rec),
        # Backward FLOPs really done (twice the forward's GEMMs): MoK's count puts shapes without
        # a shared expert above the dense ceiling. Worked out here: older records lack it.
        "pt_bwd_tflops_performed": _performed_tflops(rec, 2, (*pipe, "backward")),
        "mok_bwd_tflops_performed": _performed_tflops(rec, 2, ("mok", "backward")),
        # The pipeline's FLOPs really done (the same rows as mok's), and over the ceiling: what
        # the plots set beside mok's performed figures (one FLOP count on one axis).
        "pt_tflops_performed": pt_tflops_performed,
        "pt_frac_performed": records.ratio(pt_tflops_performed, _get(rec, "ceilings", "dense_bf16_tflops")),
    }


def _performed_tflops(rec, times, timed):
    """`times` x the forward's performed FLOPs over the median of the timing at path `timed`."""
    flops, ms = _get(rec, "flops", "performed_forward"), _get(rec, *timed, "median_ms")
    return records.ratio(None if flops is None else times * flops, None if ms is None else ms * 1e9)


def speedup_at_ceiling(rec):
    """The speedup over the PyTorch pipeline of a layer that did the rank's performed FLOPs at
    exactly the dense bf16 GEMM rate measured in the same run, and nothing else (no routing,
    gather or combine cost). A layer beats it only by out-running that dense GEMM."""
    dense = _get(rec, "ceilings", "dense_bf16_tflops")
    flops = _get(rec, "flops", "performed_forward")
    at_ceiling_ms = records.ratio(flops, None if dense is None else dense * 1e9)
    return records.ratio(_get(rec, "peers", "pytorch_pipeline", "forward", "median_ms"), at_ceiling_ms)


# ---- markdown ---------------------------------------------------------------------------

def ep_text(rec):
    ep = (rec.get("problem") or {}).get("ep_size")
    return f"{rec['ep_mode']} (EP={ep})" if ep is not None else rec["ep_mode"]


def routing_lines(recs):
    """Which routing each record used and how unbalanced it was (from mok bench's count of
    the rows every expert and every rank receives)."""
    lines = ["## Routing", "",
             "Max rows per expert (and per rank) over the mean, over the whole EP group's batch: "
             "1.00 is perfectly balanced; the slowest expert or rank sets the pace. Measured rank: the "
             "rank a slice ran (by default the busiest) and the real rows its experts received.", "",
             "| shape | EP mode | tokens | routing | max/mean rows per expert | max/mean rows per rank "
             "| measured rank (rows) | run |",
             "|---|---|---|---|---|---|---|---|"]
    for rec in recs:
        r = rec.get("routing") or {}
        rows = (rec.get("rows") or {}).get("real")
        measured = "–" if rec.get("active_rank") is None else f"{rec['active_rank']} ({fmt(rows, 'd')})"
        cells = [rec["shape"], ep_text(rec), rec["tokens_per_rank"], routing_spec(rec),
                 fmt(r.get("max_over_mean_expert"), ".2f"), fmt(r.get("max_over_mean_rank"), ".2f"), measured,
                 run_text(rec)]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines + [""]


def phase_names(recs):
    """The phases any record measured, in the forward's order (records.PHASE_ORDER first)."""
    seen = []
    for rec in recs:
        for name in (_get(rec, "mok", "forward_phases", "median_ms") or {}):
            if name not in seen:
                seen.append(name)
    known = [n for n in records.PHASE_ORDER if n in seen]
    return known + [n for n in seen if n not in known]


def phase_pass(rec):
    """How a record's phase pass ran its forwards (from the method mok bench wrote)."""
    method = _get(rec, "mok", "forward_phases", "method") or ""
    if "right after the timed run" in method:
        return "right after the timed run"
    return "back to back, after the check" if "back to back" in method else "one at a time"


def phase_lines(recs):
    """Where mok's forward time goes, for the records that measured it."""
    with_phases = [r for r in recs if _get(r, "mok", "forward_phases", "median_ms")]
    if not with_phases:
        return []
    names = phase_names(with_phases)
    lines = ["## Where mok's forward time goes", "",
             "Medians of a separate pass of 20 forwards with CUDA events between the phases (the "
             "events serialise what runs overlapped in the timed run). pass: how that pass ran its "
             "forwards: back to back right after the timed run (500 warm-up and 100 timed "
             "forwards), in the state the timed run left the GPU in; or (older records) back to "
             "back after the check, which follows up to seconds of host copies with the GPU idle "
             "(those passes' phases sum to 5-13% less than the timed median: a cooler GPU clocks "
             "higher under the power cap, the likely cause); or one at a time with a host wait "
             "after each. ncu's per-kernel times after 10 (scripts/device_perf.sh) "
             "put the megakernel ~10% lower. setup = counter "
             "reset (and in a real group: staging x, gathering the ids), schedule = the schedule and "
             "plan kernels, megakernel = dispatch, every expert FFN and the combine push, epilogue = "
             "the fixed-order sum into y. timed after ms: the median of 20 more forwards, timed the way "
             "the timed run times them (PDL on, no events between the phases), right after the pass (newer "
             "records): the sum minus it is what the pass's own way of running costs, it minus the "
             "timed median how far the GPU's state moved since the timed run.", "",
             "| shape | EP mode | tokens | " + " | ".join(f"{n} ms" for n in names)
             + " | sum ms | timed after ms | timed median ms | megakernel share | pass | run |",
             "|" + "---|" * (len(names) + 9)]
    for rec in with_phases:
        med = _get(rec, "mok", "forward_phases", "median_ms")
        total = sum(med.values())
        mega = med.get("megakernel")
        cells = [rec["shape"], ep_text(rec), rec["tokens_per_rank"]] + \
                [fmt(med.get(n), ".3f") for n in names] + \
                [fmt(total, ".3f"), fmt(_get(rec, "mok", "forward_phases", "timed_after_ms"), ".3f"),
                 fmt(values(rec)["mok_ms"], ".3f"),
                 fmt(None if mega is None or total <= 0 else 100 * mega / total, ".1f", "%"),
                 phase_pass(rec), run_text(rec)]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines + [""]


def _clock_cell(summary):
    """"MHz / W (samples)" of one timed loop's clock summary ("–" when not sampled)."""
    if not summary:
        return "–"
    if not summary.get("samples"):
        return "no samples"
    return (f"{fmt(summary.get('sm_mhz_median'), '.0f')} / {fmt(summary.get('power_w_median'), '.0f')} "
            f"({summary['samples']})")


def clock_lines(recs):
    """The SM clock and power each timed loop ran at, for the records that sampled them."""
    sampled = [r for r in recs if isinstance(r.get("clocks"), dict)]
    if not sampled:
        return []
    lines = ["## Clocks and power in the timed loops", "",
             "nvidia-smi samples taken beside the timed programs (bench/gpu_clocks.py, every 10 ms "
             "by default): per timed loop the median SM clock (MHz) and board power (W) of the samples "
             "inside it, and how many there were. power cap: the share of mok's samples with the "
             "software power cap holding the clock down. tensor peak: the SMs' dense bf16 tensor rate at "
             "mok's median clock (SMs x FLOPs per SM per clock x clock; 4096 on sm_90, from the "
             "H100/H200's 989.4 TFLOP/s at 1830 MHz), with mok's performed TFLOP/s and the dense "
             "ceiling's (at its own clock) as shares of it. pJ/FLOP: board energy per FLOP, median "
             "power over the performed rate; at the power cap a layer's time is its energy over the "
             "capped power, so this says how far it is from the dense GEMM. A short loop (mok's 100 "
             "forwards at 512 tokens: ~30 ms) gets few samples.", "",
             "| shape | EP mode | tokens | mok | PyTorch pipeline | grouped GEMMs | dense ceiling "
             "| power cap (mok) | tensor peak at mok's clock TFLOP/s | mok performed of peak "
             "| dense ceiling of peak | mok pJ/FLOP | dense ceiling pJ/FLOP | run |", "|" + "---|" * 14]
    for rec in sampled:
        c = rec["clocks"]
        if c.get("error") and not any(isinstance(c.get(k), dict) and c[k].get("samples")
                                      for k in ("mok_forward", "pytorch_forward")):
            cells = [rec["shape"], ep_text(rec), rec["tokens_per_rank"], f"not sampled: {c['error']}"] + ["–"] * 9 + [run_text(rec)]
        else:
            cap = (c.get("mok_forward") or {}).get("sw_power_cap_share")
            # Worked out from the record's parts when it predates the stored values (9c2d48c's).
            mok_pj = c.get("mok_forward_pj_per_flop", records.pj_per_flop(
                (c.get("mok_forward") or {}).get("power_w_median"), _get(rec, "mok", "forward", "tflops_performed")))
            dense_pj = c.get("dense_bf16_pj_per_flop", records.pj_per_flop(
                (c.get("dense_bf16_ceiling") or {}).get("power_w_median"), _get(rec, "ceilings", "dense_bf16_tflops")))
            cells = [rec["shape"], ep_text(rec), rec["tokens_per_rank"], _clock_cell(c.get("mok_forward")),
                     _clock_cell(c.get("pytorch_forward")), _clock_cell(c.get("pytorch_grouped_gemms")),
                     _clock_cell(c.get("dense_bf16_ceiling")), pct(cap),
                     fmt(c.get("tensor_peak_bf16_tflops_at_mok_clock"), ".0f"),
                     pct(c.get("mok_forward_performed_of_tensor_peak")),
                     pct(c.get("dense_bf16_of_tensor_peak_at_its_clock")),
                     fmt(mok_pj, ".2f"), fmt(dense_pj, ".2f"), run_text(rec)]
        lines.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    return lines + [""]


def _following_cells(summary):
    """[pairs, ms spread, cycles spread, r] of a loop's clock_following figures ("–" when absent)."""
    it = (summary or {}).get("iterations") if isinstance(summary, dict) else None
    if not isinstance(it, dict):
        return ["–"] * 4
    return [it.get("pairs", "–"), pct(it.get("ms_spread")), pct(it.get("cycles_spread")),
            fmt(it.get("r_ms_vs_clock_period"), ".2f")]


def spread_lines(recs):
    """Whether each timed loop's spread is the clock's, for the records whose clocks carry the
    iteration pairs (records.clock_section)."""
    shown = [r for r in recs if isinstance(r.get("clocks"), dict)
             and any(isinstance(r["clocks"].get(k), dict) and isinstance(r["clocks"][k].get("iterations"), dict)
                     for k in ("mok_forward", "pytorch_forward"))]
    if not shown:
        return []
    lines = ["## Spread against the clock", "",
             "Each clock sample taken inside a timed iteration pairs that iteration's time with the SM clock "
             "(bench/gpu_clocks.py clock_following). spread: (90th - 10th percentile) / median of the paired "
             "iterations' times (ms) and of those times x the clock (cycles: the clock cycles the iteration "
             "took, had the clock held through it). r: Pearson's correlation of the time with the clock's "
             "period (1/MHz). A loop whose cycles spread far less than its ms, with r near 1, spreads because "
             "the power management moved the clock, not because its work did. The sampled clock adds noise of "
             "its own (nvidia-smi's ~15 MHz steps, a clock moving within an iteration): a loop at a steady "
             "clock shows a cycles spread a few percent above its ms spread. A real group's loops are not "
             "paired (their iterations cannot be placed in time).", "",
             "| shape | EP mode | tokens | mok pairs | mok ms spread | mok cycles spread | mok r "
             "| PyTorch pairs | PyTorch ms spread | PyTorch cycles spread | PyTorch r | run |", "|" + "---|" * 12]
    for rec in shown:
        c = rec["clocks"]
        cells = ([rec["shape"], ep_text(rec), rec["tokens_per_rank"]] + _following_cells(c.get("mok_forward"))
                 + _following_cells(c.get("pytorch_forward")) + [run_text(rec)])
        lines.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    return lines + [""]


def _phase_plot(path, recs):
    plt = _plt()
    names = phase_names(recs)
    multi = len({routing_spec(r) for r in recs}) > 1
    labels = [_label(r, multi).replace("\n", " ") for r in recs]
    fig, ax = plt.subplots(figsize=(8.0, 0.55 * len(recs) + 1.6))
    left = [0.0] * len(recs)
    for name in names:
        widths = [float((_get(r, "mok", "forward_phases", "median_ms") or {}).get(name, 0.0)) for r in recs]
        ax.barh(range(len(recs)), widths, left=left, label=name)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(range(len(recs)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms (median of the phase pass)")
    ax.set_title("mok forward: time by phase")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, ncol=len(names), loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cell(text):
    return str(text).replace("|", "\\|")


def markdown(recs, plots, out_dir, repeats=None, off_contract=None, skipped=None):
    lines = ["# mok benchmark report", "",
             "Generated by `python3 bench/report.py` from the records in `bench/results/` "
             "(bench/README.md explains every number). Forward pass, median of the timed iterations; "
             "TFLOP/s by MoK's formula 6*(T + T*k)*H*I (grouped GEMMs: the FLOPs they perform, 6*N*H*I); "
             "performed TFLOP/s = the FLOPs the rank really does (6*N*H*I for its N routed rows plus its "
             "shared experts), which for shapes without a shared expert is below MoK's count (MoK's formula "
             "counts T shared rows they do not have: k+1 over k too high); "
             "speedup = PyTorch pipeline ms / mok ms (the eager pipeline of bench/peer_torch.py: no CUDA "
             "graphs, no torch.compile; peers before a93cc1c combined in fp32 elementwise and "
             "synchronised on bincount, and peers before b587a86 unpermuted with an index_copy_ scatter "
             "and copied each row twice at EP = 1, so their speedups are higher than today's peer gives); "
             "speedup at ceiling = PyTorch pipeline ms over the "
             "time the rank's performed FLOPs take at the dense bf16 GEMM rate measured in the same run "
             "(the speedup of a layer that ran at cuBLAS's dense rate and did nothing else: beyond it "
             "only by out-running cuBLAS); % ceiling = mok TFLOP/s over the dense bf16 GEMM "
             "measured in the same run (a sustained 8192^3 torch.matmul at the power cap; MoK's formula; 'performed': the FLOPs really done, which is the "
             "honest fraction for shapes without a shared expert). peer = the PyTorch peer's code the record "
             "was measured against (checks.peer_code: a hash of its files): \"today's\" is this checkout's; "
             "records before b587a86's peer, and any before the id was kept, show as \"earlier\". When several "
             "records share shape, EP mode and size, routing, tokens, precision, GPU, extra mok bench options and "
             "megakernel environment knobs (config.env, wait limits aside), "
             "the newest against "
             "today's peer is shown, else the newest. Only records made to MoK's timing contract "
             f"({checks.WARMUP} warm-up and {checks.ITERS} timed iterations for mok and the PyTorch peer, its "
             f"ceilings at {checks.CEILING_WARMUP} / {checks.CEILING_ITERS}, the peer "
             "measured in the same run) are shown, plotted and compared; the others are listed under "
             "\"Off-contract records\". Failed records are shown as FAIL and left out of the plots.", ""]
    if not recs:
        lines += ["No records yet: run `python3 bench/run.py` on a GPU machine." if not off_contract else
                  "No record made to the timing contract yet.", ""]
        return "\n".join(lines + (off_contract or []) + (skipped or []))
    head = ["shape", "EP mode", "routing", "tokens", "precision", "mok ms", "mok TFLOP/s",
            "mok TFLOP/s performed", "PyTorch ms",
            "PyTorch TFLOP/s", "grouped GEMMs ms", "speedup", "speedup at ceiling", "% dense ceiling", "% dense ceiling performed", "check",
            "peer", "commit", "GPU"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rec in recs:
        v = values(rec)
        commit = commit_text(rec)
        cells = [rec["shape"], ep_text(rec), routing_spec(rec), rec["tokens_per_rank"], rec["precision"],
                 fmt(v["mok_ms"], ".3f"), fmt(v["mok_tflops"], ".1f"), fmt(v["mok_tflops_performed"], ".1f"),
                 fmt(v["pt_ms"], ".3f"),
                 fmt(v["pt_tflops"], ".1f"), fmt(v["gg_ms"], ".3f"), fmt(v["speedup"], ".2f", "x"),
                 fmt(v["speedup_at_ceiling"], ".2f", "x"), pct(v["mok_frac"]),
                 pct(v["mok_frac_performed"]),
                 records.check_text(rec), peer_text(rec),
                 commit, (rec.get("gpu") or {}).get("name") or "?"]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines.append("")
    lines += off_contract or []
    lines += skipped or []
    bwd = [r for r in recs if values(r)["mok_bwd_ms"] is not None or values(r)["pt_bwd_ms"] is not None]
    if bwd:
        lines += ["## Backward", "", "TFLOP/s by MoK's formula (twice the forward's); performed: the FLOPs "
                  "really done (for shapes without a shared expert MoK's count is (k+1)/k too high).", "",
                  "| shape | EP mode | routing | tokens | mok ms | mok TFLOP/s | PyTorch ms "
                  "| PyTorch TFLOP/s | PyTorch TFLOP/s performed | speedup | run |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for rec in bwd:
            v = values(rec)
            sp = records.ratio(v["pt_bwd_ms"], v["mok_bwd_ms"])
            cells = [rec["shape"], ep_text(rec), routing_spec(rec), rec["tokens_per_rank"],
                     fmt(v["mok_bwd_ms"], ".3f"), fmt(v["mok_bwd_tflops"], ".1f"), fmt(v["pt_bwd_ms"], ".3f"),
                     fmt(v["pt_bwd_tflops"], ".1f"), fmt(v["pt_bwd_tflops_performed"], ".1f"), fmt(sp, ".2f", "x"),
                     run_text(rec)]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
    lines += noise_lines(recs)
    lines += routing_lines(recs)
    lines += phase_lines(recs)
    lines += clock_lines(recs)
    lines += spread_lines(recs)
    lines += group_lines(recs)
    lines += repeats or []
    lines += ["## Ceilings measured with each record", "",
              "| shape | tokens | ceiling warm-up / timed iterations | dense bf16 TFLOP/s "
              "| fp8 e4m3 TFLOP/s (fast accum / exact) | copy GB/s "
              "| mok HBM GB/s (min bytes) | PyTorch HBM GB/s (min bytes) | run |",
              "|---|---|---|---|---|---|---|---|---|"]
    for rec in recs:
        c = rec.get("ceilings") or {}
        peer_timing = _get(rec, "timing", "peer") or {}
        lines.append("| " + " | ".join(_cell(x) for x in (
            rec["shape"], rec["tokens_per_rank"],
            fmt(peer_timing.get("ceiling_warmup"), "d") + " / " + fmt(peer_timing.get("ceiling_iters"), "d"),
            fmt(c.get("dense_bf16_tflops"), ".0f"),
            fmt(c.get("fp8_e4m3_tflops"), ".0f") + " / " + fmt(c.get("fp8_e4m3_exact_accum_tflops"), ".0f"),
            fmt(c.get("copy_gbps"), ".0f"), fmt(_get(rec, "bytes", "mok_hbm_gbps"), ".0f"),
            fmt(_get(rec, "bytes", "pytorch_hbm_gbps"), ".0f"), run_text(rec))) + " |")
    lines.append("")
    if plots:
        lines += ["## Plots", ""]
        for title, path in plots:
            rel = os.path.relpath(path, out_dir).replace(os.sep, "/")
            lines += [f"### {title}", "", f"![{title}]({rel})", ""]
    return "\n".join(lines)


# ---- plots ------------------------------------------------------------------------------

def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


class ReportError(RuntimeError):
    """The report cannot be made: nothing is written, no old plot removed (main: exit 1)."""


class MissingMatplotlib(ReportError):
    """matplotlib cannot be imported: nothing is written (nor any old plot removed)."""


class NothingToReport(ReportError):
    """Files were given (or found) and none is a readable record: a typo or a broken folder,
    not an empty suite, so the old report and plots stay."""


def require_matplotlib():
    """Imports matplotlib before anything is touched: without it the old PNGs were deleted and
    REPORT.md was left pointing at them."""
    try:
        _plt()
    except ImportError as exc:
        raise MissingMatplotlib(f"report.py: matplotlib is needed for the plots ({exc}); install it "
                                "(pip install -r bench/requirements.txt). Nothing was written.") from None


def _write_tmp(path, data):
    """Writes the bytes `data` whole into a new temporary file beside `path` (flushed, fsynced);
    returns its name. Nothing is left behind when that fails."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return tmp


def _label(rec, multi_routing):
    ep = rec["problem"].get("ep_size")
    lab = f"{rec['shape']}\nEP={ep} T={rec['tokens_per_rank']}\n{gpu_short(rec)}"
    if not todays_peer(rec):
        lab += ", earlier peer"
    if multi_routing:
        lab += f"\n{routing_spec(rec)}"
    if rec["precision"] != "bf16":
        lab += f" {rec['precision']}"
    return lab


def _grouped_bars(path, recs, series, ylabel, title, percent=False):
    plt = _plt()
    multi = len({routing_spec(r) for r in recs}) > 1
    labels = [_label(r, multi) for r in recs]
    present = [(name, key) for name, key in series if any(values(r)[key] is not None for r in recs)]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(recs) + 2), 4.8))
    width = 0.8 / max(1, len(present))
    for i, (name, key) in enumerate(present):
        ys = [values(r)[key] for r in recs]
        ys = [float("nan") if y is None else (100 * y if percent else y) for y in ys]
        xs = [j + (i - (len(present) - 1) / 2) * width for j in range(len(recs))]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks(range(len(recs)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if percent:
        ax.axhline(100, color="black", linewidth=0.8, linestyle="--")
    ax.grid(axis="y", alpha=0.3)
    if present:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# A sweep's lines, (legend, values() key): one FLOP count for every line, the FLOPs really
# performed (the grouped GEMMs' figure is 6*N*H*I already), as in the bar plots; MoK's count
# would draw a shape without shared experts (k+1)/k high against the dense ceiling.
SWEEP_SERIES = (("mok forward", "mok_tflops_performed"), ("PyTorch pipeline", "pt_tflops_performed"),
                ("PyTorch grouped GEMMs only", "gg_tflops"), ("mok backward", "mok_bwd_tflops_performed"),
                ("PyTorch backward", "pt_bwd_tflops_performed"))


def _sweep_plot(path, key, recs, peer="today's"):
    plt = _plt()
    shape, mode, routing, precision = key
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    toks = [int(r["tokens_per_rank"]) for r in recs]
    for name, k in SWEEP_SERIES:
        ys = [values(r)[k] for r in recs]
        if any(y is not None for y in ys):
            ax.plot(toks, [float("nan") if y is None else y for y in ys], marker="o", label=name)
    dense = [values(r)["dense"] for r in recs if values(r)["dense"] is not None]
    if dense:
        ax.axhline(sorted(dense)[len(dense) // 2], color="black", linestyle="--", linewidth=0.8,
                   label="dense bf16 GEMM ceiling (median of the runs)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(toks)
    ax.set_xticklabels([str(t) for t in toks])
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"{shape} {mode} ({routing}, {precision}; peer: {peer})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_file_name(key, taken):
    """The file name of a sweep's plot: sweep_<shape>_<mode><EP>_<routing>_<precision>_<GPU>.png
    (records.safe_name), with "-" and 8 hex digits of the key's sha256 after it when an earlier
    plot of this report took that name (`taken`: the names so far, casefolded, which this adds
    to). safe_name maps every other character than [A-Za-z0-9._-] to '-', so two keys ("qwén",
    "qwèn") can meet in one name; two plots in one file would leave one plot missing and the
    other shown twice. (Casefolded: a file system that ignores case holds one of two names that
    differ only in case.)"""
    shape, mode, ep, routing, precision, gpu = key
    stem = "sweep_" + records.safe_name(f"{shape}_{mode}{ep}_{routing}_{precision}_{gpu}")
    name = stem + ".png"
    if name.casefold() in taken:
        digest = hashlib.sha256(json.dumps([str(part) for part in key]).encode("utf-8")).hexdigest()
        name = f"{stem}-{digest[:8]}.png"
        n = 2
        while name.casefold() in taken:  # (a hash that meets another name too: counted on)
            name = f"{stem}-{digest[:8]}-{n}.png"
            n += 1
    taken.add(name.casefold())
    return name


def plan_plots(recs, plots_dir, loaded=None):
    """The plots the records call for, drawing nothing yet: [(title, path in plots_dir,
    draw)], where draw(file) renders that plot into `file`. Failed records are not drawn
    (bar_records, sweep_groups)."""
    out = []
    bars = bar_records(recs)  # passing records only
    if bars:
        # (Every bar by the FLOPs really done: MoK's formula counts shared rows that shapes
        # without a shared expert lack, and set beside the GEMMs' performed count it misleads.)
        out.append(("TFLOP/s per shape", os.path.join(plots_dir, PLOT_FILES[0]), functools.partial(
            _grouped_bars, recs=bars, series=[("mok forward", "mok_tflops_performed"),
                                              ("PyTorch pipeline", "pt_tflops_performed"),
                                              ("PyTorch grouped GEMMs only", "gg_tflops"),
                                              ("mok backward", "mok_bwd_tflops_performed"),
                                              ("PyTorch backward", "pt_bwd_tflops_performed")],
            ylabel="TFLOP/s", title="TFLOP/s per shape (FLOPs performed)")))
        out.append(("Fraction of the dense GEMM ceiling", os.path.join(plots_dir, PLOT_FILES[1]), functools.partial(
            _grouped_bars, recs=bars, series=[("mok forward", "mok_frac_performed"),
                                              ("PyTorch pipeline", "pt_frac_performed"),
                                              ("PyTorch grouped GEMMs only", "gg_frac")],
            ylabel="% of dense bf16 GEMM", title="Fraction of the dense bf16 GEMM ceiling (same run; FLOPs performed)",
            percent=True)))
        phased = [r for r in bars if _get(r, "mok", "forward_phases", "median_ms")]
        if phased:
            out.append(("Where mok's forward time goes", os.path.join(plots_dir, PLOT_FILES[2]),
                        functools.partial(_phase_plot, recs=phased)))
    loaded = loaded if loaded is not None else [("", r) for r in recs]
    taken = {name.casefold() for name in PLOT_FILES}
    for key, group in sorted(sweep_groups(loaded).items(), key=lambda kv: sort_key(kv[1][0])):
        shape, mode, ep, routing, precision, gpu = key
        p = os.path.join(plots_dir, sweep_file_name(key, taken))
        out.append((f"Tokens-per-rank sweep: {shape} {mode} EP={ep} ({routing}, {precision}, {gpu}, "
                    f"commit {commit_label(group[0])}, peer {peer_text(group[0])})", p,
                    functools.partial(_sweep_plot, key=(shape, mode, routing, precision), recs=group,
                                      peer=peer_text(group[0]))))
    return out


def old_plots(plots_dir):
    """The PNGs an earlier report left in plots_dir (its fixed names and every sweep_*.png)."""
    return [p for p in glob.glob(os.path.join(plots_dir, "sweep_*.png")) +
            [os.path.join(plots_dir, f) for f in PLOT_FILES] if os.path.exists(p)]


def install(planned, stage, plots_dir, tmp_report, out_path):
    """Moves the plots rendered in `stage` into plots_dir, the earlier report's plots out of it
    (this one's and those it no longer draws alike), and the markdown `tmp_report` over
    `out_path`: all of it, or, when any step fails (or Ctrl-C comes), none of it. The earlier
    plots wait in `stage`/.old (inside plots_dir: os.replace moves within one file system) until
    the markdown is in place; on a failure the new plots placed so far are removed and the
    earlier ones moved back, so REPORT.md and the plots it links stay one report's."""
    backup = os.path.join(stage, ".old")
    os.mkdir(backup)
    moved, placed = [], []
    try:
        for old in old_plots(plots_dir):
            aside = os.path.join(backup, os.path.basename(old))
            os.replace(old, aside)
            moved.append((aside, old))
        for _, path, _ in planned:
            os.replace(os.path.join(stage, os.path.basename(path)), path)
            placed.append(path)
        os.replace(tmp_report, out_path)
    except BaseException:
        for path in placed:
            try:
                os.remove(path)
            except OSError:
                pass
        for aside, old in reversed(moved):
            os.replace(aside, old)
        raise


# The folder each report renders its plots into, inside --plots-dir: ".report-<pid>-" and
# tempfile.mkdtemp's 8 characters (report.py before the pid: ".report-" and the 8 alone). The
# markdown's temporary file beside --out: "<out name>.tmp<pid>" (_write_tmp).
STAGE_PREFIX = ".report-"
STAGE_NAME = re.compile(r"\.report-(?:(\d+)-)?[a-z0-9_]{8}")
TMP_REPORT_SUFFIX = re.compile(r"\.tmp(\d+)")


def _process_alive(pid):
    """Whether process `pid` runs on this machine (another report.py still at work); this
    process itself counts as not alive: no report of its own is under way when it starts one,
    and a killed report.py's pid may come back (a container numbers its processes alike)."""
    if pid == os.getpid():
        return False
    if os.name != "posix":
        return True  # (no way to tell here: kept)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (PermissionError: another user's process, alive)
        return True
    return True


def remove_stale_staging(plots_dir, out_path, keep=None):
    """Removes what a report.py killed mid-way (no `finally` ran) left: its staging folders in
    `plots_dir` (STAGE_NAME, folders only, not links) and its markdown's temporary file beside
    `out_path` ("<out name>.tmp<pid>"), except those of a report.py still running here (the pid
    in the name is a live process's) and `keep` (this report's own temporary file). Only those
    names, only in those two folders; each removal is said on stderr."""
    stale = []
    if os.path.isdir(plots_dir):
        for name in sorted(os.listdir(plots_dir)):
            m = STAGE_NAME.fullmatch(name)
            path = os.path.join(plots_dir, name)
            if m and os.path.isdir(path) and not os.path.islink(path) and not (
                    m.group(1) and _process_alive(int(m.group(1)))):
                stale.append(path)
                shutil.rmtree(path, ignore_errors=True)
    out_dir, base = os.path.split(os.path.abspath(out_path))
    if os.path.isdir(out_dir):
        for name in sorted(os.listdir(out_dir)):
            m = TMP_REPORT_SUFFIX.fullmatch(name[len(base):]) if name.startswith(base) else None
            path = os.path.join(out_dir, name)
            if (m and os.path.isfile(path) and not os.path.islink(path) and not _process_alive(int(m.group(1)))
                    and (keep is None or os.path.abspath(path) != os.path.abspath(keep))):
                stale.append(path)
                try:
                    os.remove(path)
                except OSError:
                    pass
    for path in stale:
        print(f"report.py: removed {path}, left by a report.py that was stopped mid-way (stale)", file=sys.stderr)
    return stale


def generate(paths, out_path=DEFAULT_OUT, plots_dir=DEFAULT_PLOTS):
    """Reads the records at `paths`, writes the markdown and the plots; returns the records shown
    in the main table (contract records only: split_contract).

    Nothing is touched until everything is ready: the whole markdown is built (and encoded)
    and written to a temporary file beside --out (so --out's folder is known to be writable),
    then every plot is rendered into a temporary folder inside plots_dir; only then are the
    plots moved in (the earlier report's moved aside) and the markdown renamed over --out, all
    or nothing (install). A failure anywhere leaves the old REPORT.md and plots as they were. The temporary file
    and folder are removed on any exit that runs Python's `finally` (an exception, Ctrl-C);
    those of a report.py killed outright are removed by the next one, before it stages its own
    (remove_stale_staging). Raises
    NothingToReport when files were given and none of them loads (the files skipped are listed
    in REPORT.md otherwise), MissingMatplotlib without matplotlib, ReportError when --out's
    folder is not writable or --out is a folder."""
    if os.path.isdir(out_path):
        # (Checked first: the markdown's rename over a folder fails only after every plot is
        # drawn; install would undo the plots then, but nothing need be drawn for it.)
        raise ReportError(f"report.py: --out {out_path}: is a folder; give the markdown file's path "
                          f"(e.g. {os.path.join(out_path, 'REPORT.md')}). Nothing was written.")
    require_matplotlib()
    skipped = []
    everything = load_records(paths, skipped)
    if paths and not everything:
        raise NothingToReport(f"report.py: none of the {len(paths)} file(s) given is a readable record "
                              "(see the messages above). Nothing was written.")
    loaded, off = split_contract(everything)
    for _, copy_path, first_path in duplicate_runs(loaded):
        print(f"report.py: {copy_path} holds the same run as {first_path} (the same date, commit and timings: "
              "a copy): counted once in the repeat table", file=sys.stderr)
    recs = newest_per_key(loaded)
    planned = plan_plots(recs, plots_dir, loaded)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    text = markdown(recs, [(title, path) for title, path, _ in planned], out_dir, repeat_lines(loaded),
                    off_contract_lines(off), skipped_lines(skipped, out_dir))
    data = (text + "\n").encode("utf-8")  # (text that cannot be written fails here, before anything is touched)
    try:
        tmp_report = _write_tmp(out_path, data)
    except OSError as exc:
        raise ReportError(f"report.py: --out {out_path}: cannot be written ({type(exc).__name__}: {exc}). "
                          "Nothing was written.") from None
    stage = None
    try:
        try:
            os.makedirs(plots_dir, exist_ok=True)
            remove_stale_staging(plots_dir, out_path, tmp_report)
            stage = tempfile.mkdtemp(prefix=f"{STAGE_PREFIX}{os.getpid()}-", dir=plots_dir)
        except OSError as exc:
            raise ReportError(f"report.py: --plots-dir {plots_dir}: cannot be written ({type(exc).__name__}: "
                              f"{exc}). Nothing was written.") from None
        for _, path, draw in planned:
            draw(os.path.join(stage, os.path.basename(path)))
        install(planned, stage, plots_dir, tmp_report, out_path)
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        if os.path.exists(tmp_report):
            os.remove(tmp_report)
    return recs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="record files (default: every .json in --results-dir)")
    ap.add_argument("--results-dir", default=records.RESULTS_DIR)
    ap.add_argument("--out", default=DEFAULT_OUT, help="the markdown file to write")
    ap.add_argument("--plots-dir", default=DEFAULT_PLOTS)
    args = ap.parse_args(argv)
    if not args.files and not os.path.isdir(args.results_dir):
        # (A typo must not rewrite REPORT.md as "No records yet" and delete every plot.)
        what = "not a folder" if os.path.exists(args.results_dir) else "no such folder"
        print(f"report.py: --results-dir {args.results_dir}: {what}. Nothing was written.", file=sys.stderr)
        return 1
    paths = args.files or sorted(glob.glob(os.path.join(glob.escape(args.results_dir), "*.json")))
    try:
        recs = generate(paths, args.out, args.plots_dir)
    except ReportError as exc:
        print(exc, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # (generate's finally and install have put everything back: the old report stands.)
        print(f"report.py: interrupted (Ctrl-C); {args.out} and the plots in {args.plots_dir} are as they were",
              file=sys.stderr)
        return 130
    print(f"report.py: {len(recs)} record(s) -> {args.out}, plots in {args.plots_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
