#!/usr/bin/env python3
"""Runs the benchmark suite on the GPU: mok, then the PyTorch peer, then one record per run.

    python3 bench/run.py                          # the seven default shapes
    python3 bench/run.py --shapes glm-5.2,qwen3-30b-a3b
    python3 bench/run.py --sweep --shapes qwen3.5-397b-a17b   # tokens per rank 512..16384
    python3 bench/run.py --repeat 2               # every default shape twice (the repeat table)
    python3 bench/run.py --launch 8 --shapes qwen3.5-397b-a17b # a real EP group, one process per GPU

For each run: `MOK_BIN bench --shape S --ep-mode M --ep R --tokens T --routing X --warmup W
--iters N --work-dir DIR`, then `python3 bench/peer_torch.py DIR --warmup W --iters N`, then
a record in bench/results/ (records.py). One failing run does not stop the others; the exit
status is non-zero when any run failed, and a summary table is printed last.
Exit status 2: no CUDA GPU (or no PyTorch) here.
"""
import argparse
import os
import shlex
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checks  # noqa: E402
import gpu_clocks  # noqa: E402
import records  # noqa: E402
import workdir  # noqa: E402

BENCH_DIR = records.BENCH_DIR
REPO_ROOT = records.REPO_ROOT

# (shape, ep mode, EP size, tokens per rank): MoK's four shapes as one rank's slice of an
# EP-64 group at 2048 tokens per rank, and the single-GPU shapes at EP=1.
DEFAULT_RUNS = [
    ("qwen3.5-397b-a17b", "slice", 64, 2048),
    ("deepseek-v4-pro", "slice", 64, 2048),
    ("kimi-k2.7-code", "slice", 64, 2048),
    ("glm-5.2", "slice", 64, 2048),
    ("qwen3-30b-a3b", "all", 1, 16384),
    ("mixtral-8x7b", "all", 1, 4096),
    ("gpt-oss-20b", "all", 1, 4096),
]
SWEEP_TOKENS = [512, 1024, 2048, 4096, 8192, 16384]
NO_GPU_EXIT = 2


def cuda_status(assume_no_gpu=False):
    """(True, description) when torch sees a CUDA GPU, else (False, why)."""
    if assume_no_gpu:
        return False, "--assume-no-gpu was given"
    try:
        import torch
    except ImportError as exc:
        return False, f"PyTorch cannot be imported ({exc})"
    try:
        if not torch.cuda.is_available():
            return False, "torch.cuda.is_available() is False"
        return True, torch.cuda.get_device_name(0)
    except Exception as exc:  # a broken driver shows up here
        return False, f"CUDA is not usable ({type(exc).__name__}: {exc})"


def plan_runs(args):
    """The list of (shape, ep_mode, ep, tokens) to run, from the command line; with --repeat N
    the whole list N times over (pass after pass, so each repeat sees the GPU as a new run
    would: the records of one commit then show in the report's repeat table)."""
    return _plan_once(args) * max(1, getattr(args, "repeat", 1) or 1)


def _given(value, default):
    """An option's value when it was given (0 included: option_errors refuses it, it is never
    silently the default), else the default."""
    return default if value is None else value


def sweep_tokens(text):
    """--sweep-tokens "512,1024" -> [512, 1024]; SystemExit naming the option for anything else."""
    out = []
    for part in text.split(","):
        try:
            n = int(part.strip())
        except ValueError:
            n = None
        if n is None or n < 1:
            raise SystemExit(f"run.py: --sweep-tokens: {part.strip()!r} is not a whole number >= 1 "
                             "(comma-separated tokens per rank, e.g. 512,2048)")
        out.append(n)
    return out


def _plan_once(args):
    if args.launch is not None:
        # A real group runs each shape at --tokens (or its default) as EP = --launch: the
        # options that choose other runs do not apply, and are refused rather than ignored.
        for opt, val in (("--sweep", args.sweep), ("--sweep-tokens", args.sweep_tokens), ("--ep", args.ep),
                         ("--ep-mode", args.ep_mode)):
            if val is not None and val is not False:
                raise SystemExit(f"run.py: {opt} does not apply with --launch (a real group of --launch ranks)")
        shapes = [s for s in (args.shapes.split(",") if args.shapes else []) if s] or ["qwen3.5-397b-a17b"]
        tokens = {s: t for s, _, _, t in DEFAULT_RUNS}
        return [(s, "distributed", args.launch, _given(args.tokens, tokens.get(s))) for s in shapes]
    defaults = {s: (m, r, t) for s, m, r, t in DEFAULT_RUNS}
    shapes = [s for s in (args.shapes.split(",") if args.shapes else []) if s]
    if args.sweep:
        if len(shapes) != 1:
            raise SystemExit("run.py: --sweep needs exactly one shape (--shapes NAME)")
        if args.tokens is not None:
            raise SystemExit("run.py: --tokens does not apply with --sweep (the sweep's tokens per rank: "
                             "--sweep-tokens)")
        tokens = sweep_tokens(args.sweep_tokens) if args.sweep_tokens is not None else SWEEP_TOKENS
        mode, ep, _ = defaults.get(shapes[0], ("slice", 64, None))
        return [(shapes[0], args.ep_mode or mode, _given(args.ep, ep), t) for t in tokens]
    if args.sweep_tokens is not None:
        raise SystemExit("run.py: --sweep-tokens applies only with --sweep (one run per listed token count)")
    if not shapes:
        shapes = [s for s, _, _, _ in DEFAULT_RUNS]
    runs = []
    for s in shapes:
        mode, ep, tokens = defaults.get(s, (None, None, None))
        runs.append((s, args.ep_mode or mode, _given(args.ep, ep), _given(args.tokens, tokens)))
    return runs


def option_errors(args):
    """Messages for the numeric options that break their rule (each names the option), checked
    before anything runs: a 0 must not fall back to a default, and a bad ceiling option must
    not fail the peer after mok has run."""
    errors = []
    for opt, value, least in (("--iters", args.iters, 1), ("--warmup", args.warmup, 0),
                              ("--ceiling-iters", args.ceiling_iters, 1), ("--ceiling-warmup", args.ceiling_warmup, 0),
                              ("--tokens", args.tokens, 1), ("--ep", args.ep, 1), ("--launch", args.launch, 1),
                              ("--repeat", args.repeat, 1), ("--clock-period-ms", args.clock_period_ms, 1),
                              ("--profile-peer", args.profile_peer, 0)):
        if value is not None and value < least:
            errors.append(f"{opt} must be >= {least} (got {value})")
    if args.profile_peer and args.launch:
        errors.append("--profile-peer profiles the one-process peer (peer_torch.py), not --launch's")
    if args.profile_peer and args.no_peer:
        errors.append("--profile-peer profiles the peer, which --no-peer leaves out")
    return errors


# A group's run (mok or the peer) that has not ended after this long is stopped by its
# launcher: a rank stuck outside mok's own bounded waits must not hold the suite for ever.
LAUNCH_TIMEOUT_S = 3600


def launch_prefix(args, ep_mode, ep):
    """`mok launch -n N --timeout S --` in front of a group's commands, nothing otherwise."""
    return (shlex.split(args.mok_bin) + ["launch", "-n", str(ep), "--timeout", str(LAUNCH_TIMEOUT_S), "--"]
            if ep_mode == "distributed" else [])


def mok_command(args, shape, ep_mode, ep, tokens, work):
    cmd = launch_prefix(args, ep_mode, ep) + shlex.split(args.mok_bin) + ["bench", "--shape", shape]
    if ep_mode:
        cmd += ["--ep-mode", ep_mode]
    if ep:
        cmd += ["--ep", str(ep)]
    if tokens:
        cmd += ["--tokens", str(tokens)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    cmd += ["--routing", args.routing, "--warmup", str(args.warmup), "--iters", str(args.iters), "--work-dir", work]
    for extra in args.mok_arg:
        cmd += shlex.split(extra)
    return cmd


def peer_command(args, work, ep_mode=None, ep=None):
    script = "peer_dist.py" if ep_mode == "distributed" else "peer_torch.py"
    cmd = launch_prefix(args, ep_mode, ep) + [
        sys.executable, os.path.join(BENCH_DIR, script), work, "--warmup", str(args.warmup), "--iters",
        str(args.iters), "--ceiling-warmup", str(args.ceiling_warmup), "--ceiling-iters", str(args.ceiling_iters)]
    if args.no_backward and ep_mode != "distributed":
        cmd.append("--no-backward")
    if args.profile_peer and ep_mode != "distributed":
        cmd += ["--profile", str(args.profile_peer)]
    return cmd


def load_mok(work, ep_mode, ep):
    """mok.json of a run; for a group, every rank's, merged into one (records.merge_group)."""
    if ep_mode == "distributed":
        return records.merge_group([workdir.load_mok_json(os.path.join(work, f"rank{r}")) for r in range(ep)])
    return workdir.load_mok_json(work)


def sampled_gpus(ep_mode, ep, visible=None):
    """nvidia-smi indices of the GPUs a run uses: the first visible one (all of a group's),
    from CUDA_VISIBLE_DEVICES when it lists plain indices, else counted from 0. (nvidia-smi
    numbers GPUs in PCI order; CUDA does too with CUDA_DEVICE_ORDER=PCI_BUS_ID, and on a
    machine of one GPU kind the fastest-first order is the same.)"""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    n = ep if ep_mode == "distributed" and ep else 1
    listed = [v.strip() for v in visible.split(",")] if visible else []
    if listed and all(v.isdigit() for v in listed):
        return [int(v) for v in listed[:n]]
    return list(range(n))


def start_clocks(args):
    """A started gpu_clocks.Sampler, or None with --no-clocks."""
    if args.no_clocks:
        return None
    return gpu_clocks.Sampler(period_ms=args.clock_period_ms).start()


def stop_clocks(sampler, args, ep_mode, ep):
    """What make_record takes as `clocks` (None with --no-clocks)."""
    if sampler is None:
        return None
    samples = sampler.stop()
    if sampler.error:
        print(f"run.py: no GPU clock samples for this record ({sampler.error})", flush=True)
    return {"samples": samples, "gpus": sampled_gpus(ep_mode, ep), "period_ms": args.clock_period_ms,
            "error": sampler.error}


def run_one(args, shape, ep_mode, ep, tokens):
    """Runs mok and the peer for one configuration; returns a summary row (dict)."""
    label = f"{shape} {ep_mode or '-'} EP={ep or '-'} T={tokens or '-'}"
    row = {"label": label, "shape": shape, "ok": False, "error": None, "record": None}
    work = os.path.join(args.work_root, "_".join(str(p) for p in (shape, ep_mode, ep, tokens)))
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    print(f"\n=== {label}: work directory {work}", flush=True)

    cmd = mok_command(args, shape, ep_mode, ep, tokens, work)
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    sampler = start_clocks(args)  # through mok's and the peer's timed loops
    try:
        return _run_and_record(args, cmd, row, work, ep_mode, ep, sampler)
    finally:
        if sampler is not None:
            sampler.stop()


def _run_and_record(args, cmd, row, work, ep_mode, ep, sampler):
    errors = []  # process failures after their JSON was written: the record keeps them and fails
    rc = subprocess.call(cmd)
    if rc != 0:
        row["error"] = f"mok bench exited {rc}"
        first = os.path.join(work, "rank0") if ep_mode == "distributed" else work
        if not os.path.exists(os.path.join(first, workdir.MOK_JSON)):
            return row
        # mok.json is there (a failed check, say): record the run all the same, failed.
        errors.append(row["error"])
    try:
        mok = load_mok(work, ep_mode, ep)
    except (workdir.ContractError, ValueError) as exc:
        row["error"] = row["error"] or f"mok.json: {exc}"
        return row
    try:
        # Before the peer: a commit that cannot be named makes no record, so spend no GPU time.
        env = records.collect_env(REPO_ROOT, mok)
    except ValueError as exc:
        row["error"] = f"commit: {exc}"
        return row

    peer = None
    if args.no_peer:
        print("(--no-peer: the PyTorch peer is not run)")
    else:
        cmd = peer_command(args, work, ep_mode, ep)
        print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
        rc = subprocess.call(cmd)
        peer_path = os.path.join(work, workdir.PEER_JSON)
        if os.path.exists(peer_path):
            peer = workdir.read_json(peer_path)
        elif rc != 0:  # the peer failed before writing its verdict: a failed peer, not a missing one
            # (With the timing it was asked for: a run made to the contract that failed shows as
            # FAIL in the report, rather than as off-contract behind an older passing record.)
            peer = {"check": {"passes": False}, "errors": {"peer": f"exited {rc} without writing peer.json"},
                    # (Today's peer failed: the record stands for the shape as today's FAIL.)
                    "peer_code": checks.peer_code("peer_dist" if ep_mode == "distributed" else "peer_torch"),
                    "timing": {"warmup": args.warmup, "iters": args.iters, "ceiling_warmup": args.ceiling_warmup,
                               "ceiling_iters": args.ceiling_iters}}
        if rc != 0:
            errors.append(f"{'peer_dist.py' if ep_mode == 'distributed' else 'peer_torch.py'} exited {rc}")
            row["error"] = row["error"] or errors[-1]

    clocks = stop_clocks(sampler, args, ep_mode, ep)
    record = records.make_record(mok, peer, env, clocks, errors)
    # (The options given beyond the suite's own: a record made with them times something else
    # than the defaults, and the report keeps it apart.)
    record["mok_args"] = [a for extra in args.mok_arg for a in shlex.split(extra)]
    row["record"] = record
    row["path"] = records.write_record(record, args.results_dir)
    print(f"record: {row['path']}", flush=True)
    # --no-peer with mok's check passing is what was asked for, not a failed run; its record
    # does not pass either (the summary says "no peer").
    mok_alone = not peer and record["check"]["mok"] is True and not errors
    if not record["check"]["passes"] and not row["error"] and not mok_alone:
        row["error"] = "check failed"
    row["ok"] = row["error"] is None
    if row["ok"] and not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return row


def summary_table(rows):
    head = ("run", "mok ms", "pytorch ms", "speedup", "mok TFLOP/s", "% GEMM ceil", "% performed", "check")
    fmt, pct = records.fmt, records.pct
    lines = []
    for r in rows:
        rec = r.get("record")
        if rec:
            mf = rec["mok"]["forward"] or {}
            pf = (rec.get("peers", {}).get("pytorch_pipeline") or {}).get("forward") or {}
            frac = rec["ratios"]["mok_forward_of_dense_ceiling"]
            done = rec["ratios"].get("mok_forward_performed_of_dense_ceiling")
            cells = (r["label"], fmt(mf.get("median_ms"), ".3f"), fmt(pf.get("median_ms"), ".3f"),
                     fmt(rec["ratios"]["speedup_forward_vs_pytorch"], ".2f", "x"),
                     fmt(mf.get("tflops"), ".1f"), pct(frac), pct(done), records.check_text(rec))
            if r["error"] and records.record_passes(rec):
                cells = cells[:-1] + (f"ERROR: {r['error']}",)
        else:
            cells = (r["label"], "–", "–", "–", "–", "–", "–", f"ERROR: {r['error']}")
        lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) if lines else len(h) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    out += ["  ".join(c.ljust(w) for c, w in zip(cells, widths)) for cells in lines]
    return "\n".join(out)


def passed_line(rows):
    """How many runs passed; runs that timed mok alone (--no-peer) are counted apart: they
    did not fail, and they did not pass either."""
    passed = sum(1 for r in rows if r["ok"] and r.get("record") and records.record_passes(r["record"]))
    alone = sum(1 for r in rows if r["ok"] and r.get("record") and not records.peer_ran(r["record"]))
    text = f"{passed} of {len(rows)} runs passed"
    return text + (f"; {alone} timed mok alone (no peer: not a pass)" if alone else "")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", help="comma-separated shape names (default: the seven default runs)")
    ap.add_argument("--sweep", action="store_true", help="tokens per rank 512..16384 on the one shape given")
    ap.add_argument("--sweep-tokens", help="comma-separated tokens per rank for --sweep")
    ap.add_argument("--ep-mode", choices=("slice", "all"), help="override the shape's EP mode")
    ap.add_argument("--launch", type=int, metavar="N",
                    help="a real EP group of N processes, one per GPU (mok launch; peer: peer_dist.py)")
    ap.add_argument("--ep", type=int, help="override the shape's EP size")
    ap.add_argument("--tokens", type=int, help="override the shape's tokens per rank")
    ap.add_argument("--dtype", choices=("bf16", "mxfp8"), help="passed to mok bench (default: mok's)")
    ap.add_argument("--routing", default="gaussian",
                    help="gaussian | zipf[:s] | hot[:f[:e]] | worst[:r] | file:DIR (passed to mok bench)")
    checks.add_timing_options(ap)
    ap.add_argument("--mok-bin", default=shlex.quote(os.path.join(REPO_ROOT, "build", "bin", "mok")),
                    help="the mok binary (a command line: split like a shell would, so quote a path with blanks)")
    ap.add_argument("--mok-arg", action="append", default=[], help="extra argument(s) for mok bench; repeatable")
    ap.add_argument("--work-root", default=os.path.join(BENCH_DIR, "work"))
    ap.add_argument("--results-dir", default=records.RESULTS_DIR)
    ap.add_argument("--keep-work", action="store_true", help="keep each work directory (large .npy files)")
    ap.add_argument("--no-backward", action="store_true", help="skip the peer's backward timing")
    ap.add_argument("--no-peer", action="store_true", help="record mok alone (no PyTorch peer)")
    ap.add_argument("--profile-peer", type=int, default=0, metavar="N",
                    help="profile N forwards of the PyTorch peer after its timing (torch.profiler; in the "
                         "record's peers.pytorch_pipeline.profile; not with --launch)")
    ap.add_argument("--no-clocks", action="store_true",
                    help="do not sample the GPU's clock and power with nvidia-smi (the record's clocks are null)")
    ap.add_argument("--clock-period-ms", type=int, default=gpu_clocks.DEFAULT_PERIOD_MS,
                    help="nvidia-smi's sampling period")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the whole list this many times, pass after pass (a record each)")
    ap.add_argument("--assume-no-gpu", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    errors = option_errors(args)
    if errors:
        ap.error("; ".join(errors))
    runs = plan_runs(args)  # refuses options that do not apply, before anything runs

    ok, what = cuda_status(args.assume_no_gpu)
    if not ok:
        print(f"run.py: no CUDA GPU: {what}.\n"
              f"The benchmarks run on a machine with an NVIDIA GPU and PyTorch (see bench/README.md);\n"
              f"`python3 bench/report.py` regenerates the report from existing records anywhere.",
              file=sys.stderr)
        return NO_GPU_EXIT
    mok_exe = shlex.split(args.mok_bin)[0] if args.mok_bin.strip() else ""
    if not (shutil.which(mok_exe) or os.path.isfile(mok_exe)):
        print(f"run.py: the mok binary '{args.mok_bin}' does not exist; build it (cmake) or pass --mok-bin",
              file=sys.stderr)
        return 1
    print(f"run.py: GPU {what}")
    rows = []
    for shape, mode, ep, tokens in runs:
        try:
            rows.append(run_one(args, shape, mode, ep, tokens))
        except Exception as exc:  # keep going with the next run
            rows.append({"label": f"{shape} {mode} EP={ep} T={tokens}", "shape": shape, "ok": False,
                         "error": f"{type(exc).__name__}: {exc}", "record": None})
    failed = [r for r in rows if not r["ok"]]
    print("\n" + passed_line(rows))
    print(summary_table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
