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
Exit status 2: no CUDA GPU (or no PyTorch) here. Stopped by Ctrl-C (SIGINT) or SIGTERM: the
running mok or peer is stopped, the summary of the runs that finished is printed, exit 130 or 143.
"""
import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

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
# --repeat's most passes: every pass runs the whole list on the GPU (minutes a shape), so more is
# a typo, and the plan (one entry per run) must not be built a billion entries long.
MAX_REPEAT = 1000


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
    return _plan_once(args) * repeats(args)


def repeats(args):
    """--repeat's count of passes (1 when not given)."""
    return max(1, getattr(args, "repeat", 1) or 1)


# A shape name becomes a part of a work directory's name under --work-root (which run.py
# deletes and recreates): no separator, no "..", no leading dot or dash.
SHAPE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def shape_list(text):
    """--shapes "a, b" -> ["a", "b"] (blanks around each name stripped); [] when not given."""
    return [part.strip() for part in text.split(",")] if text is not None else []


def shape_errors(text):
    """Messages for a --shapes value that breaks its rule (each names the option): an empty
    field ("a,,b", ",", ""), a name given twice, or one that does not match SHAPE_NAME."""
    if text is None:
        return []
    errors, seen = [], set()
    for name in shape_list(text):
        if not name:
            errors.append(f"--shapes {text!r}: an empty name (comma-separated shape names, e.g. glm-5.2,mixtral-8x7b)")
        elif not SHAPE_NAME.fullmatch(name):
            errors.append(f"--shapes: {name!r} is not a shape name (letters, digits, '.', '_' and '-', "
                          "starting with a letter or digit)")
        elif name in seen:
            errors.append(f"--shapes: {name!r} is given twice (use --repeat to run a shape again)")
        seen.add(name)
    return errors


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
        shapes = [s for s in shape_list(args.shapes) if s] or ["qwen3.5-397b-a17b"]
        tokens = {s: t for s, _, _, t in DEFAULT_RUNS}
        return [(s, "distributed", args.launch, _given(args.tokens, tokens.get(s))) for s in shapes]
    defaults = {s: (m, r, t) for s, m, r, t in DEFAULT_RUNS}
    shapes = [s for s in shape_list(args.shapes) if s]
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
    if args.repeat is not None and args.repeat > MAX_REPEAT:
        errors.append(f"--repeat must be <= {MAX_REPEAT} (got {args.repeat}): each pass runs the whole list again")
    if args.profile_peer and args.launch:
        errors.append("--profile-peer profiles the one-process peer (peer_torch.py), not --launch's")
    if args.profile_peer and args.no_peer:
        errors.append("--profile-peer profiles the peer, which --no-peer leaves out")
    errors += shape_errors(args.shapes)
    errors += mok_arg_errors(getattr(args, "mok_arg", None))
    errors += mok_bin_errors(getattr(args, "mok_bin", None))
    errors += folder_errors(getattr(args, "results_dir", None), getattr(args, "work_root", None))
    return errors


def mok_bin_errors(mok_bin):
    """Messages for a --mok-bin that cannot be split like a shell would (an unbalanced quote):
    it is a command line (shlex.split), and a value that does not split is no command."""
    if mok_bin is None:
        return []
    try:
        shlex.split(mok_bin)
    except ValueError as exc:
        return [f"--mok-bin {mok_bin!r}: cannot be split like a shell would ({exc}); quote a path with blanks "
                "as a shell would"]
    return []


def _inside(path, folder):
    """Whether real path `path` is `folder` or lies in it (both real paths)."""
    return path == folder or os.path.commonpath([path, folder]) == folder


def folder_errors(results_dir, work_root):
    """Messages for a --results-dir and a --work-root that overlap: the same folder, or one
    inside the other (real paths: a link counts). run.py deletes each run's work directory under
    --work-root (and a work directory's name is the run's, which a record's folder may hold), so
    records inside it could be deleted; and a --work-root inside --results-dir would put work
    directories, and their JSON files, among the records."""
    if results_dir is None or work_root is None:
        return []
    results, work = os.path.realpath(results_dir), os.path.realpath(work_root)
    if _inside(results, work):
        return [f"--results-dir {results_dir} lies inside --work-root {work_root} (or is it), where run.py "
                "deletes work directories: give a --results-dir outside it"]
    if _inside(work, results):
        return [f"--work-root {work_root} lies inside --results-dir {results_dir}: give a --work-root outside "
                "the records' folder"]
    return []


# The options of `mok bench` that run.py sets itself (mok_command), each with the run.py option
# that chooses it. A --mok-arg may not give one of them: the record states run.py's settings
# (its timing contract's iterations, the shape, tokens, EP, routing, precision, where the work
# goes), and a second value passed behind run.py's back would make it claim settings it was
# not measured with (or, for those run.py leaves out when not asked, e.g. --tokens for a shape
# it has no default for, choose them unseen).
MOK_OPTIONS_RUN_PY_SETS = {
    "--shape": "run.py's --shapes",
    "--ep-mode": "run.py's --ep-mode, or --launch for a real group",
    "--ep": "run.py's --ep, or --launch for a real group",
    "--tokens": "run.py's --tokens, or --sweep-tokens with --sweep",
    "--dtype": "run.py's --dtype",
    "--routing": "run.py's --routing",
    "--warmup": "run.py's --warmup",
    "--iters": "run.py's --iters",
    "--work-dir": "run.py's --work-root",
    "--no-peer-inputs": "run.py's --no-peer",
}


def mok_arg_errors(mok_args):
    """Messages for the --mok-arg values that give an option run.py sets itself
    (MOK_OPTIONS_RUN_PY_SETS), as `--opt value` or `--opt=value` (mok's own parser reads both),
    each naming the value, the option and the run.py option to use instead; and for a value
    that cannot be split like a shell would."""
    errors = []
    for extra in mok_args or []:
        try:
            words = shlex.split(extra)
        except ValueError as exc:
            errors.append(f"--mok-arg {extra!r}: cannot be split like a shell would ({exc})")
            continue
        for word in words:
            name = word.split("=", 1)[0]
            if name in MOK_OPTIONS_RUN_PY_SETS:
                errors.append(f"--mok-arg {extra!r}: {name} is set by run.py itself "
                              f"(use {MOK_OPTIONS_RUN_PY_SETS[name]})")
    return errors


def results_dir_error(results_dir):
    """Why records cannot be written into `results_dir` (created here when missing), or None:
    checked before anything runs, so that no GPU time is spent on a run whose record would be
    lost (a --results-dir that is a file, or not writable)."""
    try:
        os.makedirs(results_dir, exist_ok=True)
        # A probe file (not *.json: report.py never reads it), removed at once.
        with tempfile.NamedTemporaryFile(dir=results_dir, prefix=".run-py-probe-", suffix=".tmp"):
            pass
    except OSError as exc:
        return f"--results-dir {results_dir}: records cannot be written there ({type(exc).__name__}: {exc})"
    return None


def work_root_error(work_root):
    """Why work directories cannot be made under `work_root` (created here when missing), or
    None: checked before anything runs, like --results-dir, so that a --work-root that is a file
    or not writable is said once, by name, rather than failing every run."""
    try:
        os.makedirs(work_root, exist_ok=True)
        probe = tempfile.mkdtemp(dir=work_root, prefix=".run-py-probe-")
        os.rmdir(probe)
    except OSError as exc:
        return f"--work-root {work_root}: work directories cannot be made there ({type(exc).__name__}: {exc})"
    return None


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
    if args.no_peer:  # (no peer reads them: a wide shape's weights are GBs to write)
        cmd.append("--no-peer-inputs")
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
        return records.merge_group([records.load_mok_json(os.path.join(work, f"rank{r}")) for r in range(ep)])
    return records.load_mok_json(work)


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


def work_dir(args, shape, ep_mode, ep, tokens, pass_index=None):
    """The run's work directory under --work-root: shape_mode_ep_tokens, and _pass<P> (from 1)
    when --repeat runs the list more than once (pass_index from 0), so that --keep-work keeps
    every pass's work and a pass never deletes the one before it."""
    name = "_".join(str(p) for p in (shape, ep_mode, ep, tokens))
    if pass_index is not None:
        name += f"_pass{pass_index + 1}"
    return os.path.join(args.work_root, name)


def remove_work(work, work_root):
    """shutil.rmtree(work), only when its real path lies inside --work-root's real path (and is
    not the root itself): a name that escaped it (a link, '..') must never delete anything else;
    and never while it holds a record an earlier run could not write (rescued_record_error)."""
    real, root = os.path.realpath(work), os.path.realpath(work_root)
    if real == root or os.path.commonpath([real, root]) != root:
        raise ValueError(f"refusing to delete {work}: its real path {real} is not inside --work-root {root}")
    why = rescued_record_error(work)
    if why:
        raise ValueError(why)
    shutil.rmtree(work, ignore_errors=True)


def rescued_record_error(work):
    """Why `work` must not be deleted, or None: it holds record.json, a record that an earlier
    run could not write into --results-dir (save_record_in_work). GPU time went into it, and a
    record is never lost: it is imported or moved away first."""
    path = os.path.join(work, RESCUED_RECORD)
    if os.path.lexists(path):
        return (f"{path} holds a record an earlier run could not write: import it "
                f"(`python3 bench/records.py import {path}`) or move it out of the work directory, then run "
                "again (run.py does not delete a work directory that holds one)")
    return None


def run_label(shape, ep_mode, ep, tokens, pass_index=None):
    """How the summary names a run: "shape mode EP=.. T=..", and "pass P" (from 1) with --repeat."""
    label = f"{shape} {ep_mode or '-'} EP={ep or '-'} T={tokens or '-'}"
    return label if pass_index is None else label + f" pass {pass_index + 1}"


def run_one(args, shape, ep_mode, ep, tokens, pass_index=None):
    """Runs mok and the peer for one configuration; returns a summary row (dict). pass_index:
    which pass of --repeat (from 0), None without --repeat."""
    label = run_label(shape, ep_mode, ep, tokens, pass_index)
    row = {"label": label, "shape": shape, "ok": False, "error": None, "record": None}
    work = work_dir(args, shape, ep_mode, ep, tokens, pass_index)
    why = rescued_record_error(work)
    if why:  # (refused before mok runs: its record would stand beside one not yet imported)
        row["error"] = why
        print(f"\n=== {label}: not run: {why}", file=sys.stderr, flush=True)
        return row
    remove_work(work, args.work_root)
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
    rc = call_child(cmd)
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
        rc = call_child(cmd)
        peer_path = os.path.join(work, workdir.PEER_JSON)
        if os.path.exists(peer_path):
            try:
                peer = records.load_peer_json(work)
            except (OSError, ValueError) as exc:
                # Unreadable (cut short, edited, a verdict that is not true or false): a failed
                # peer, named, rather than a bare JSONDecodeError that ends the run unrecorded.
                peer = failed_peer(args, ep_mode, f"{workdir.PEER_JSON} could not be read: {exc}")
                errors.append(f"{workdir.PEER_JSON} could not be read: {exc}")
                row["error"] = row["error"] or errors[-1]
        elif rc != 0:  # the peer failed before writing its verdict: a failed peer, not a missing one
            peer = failed_peer(args, ep_mode, f"exited {rc} without writing peer.json")
        if rc != 0:
            errors.append(f"{'peer_dist.py' if ep_mode == 'distributed' else 'peer_torch.py'} exited {rc}")
            row["error"] = row["error"] or errors[-1]

    clocks = stop_clocks(sampler, args, ep_mode, ep)
    record = records.make_record(mok, peer, env, clocks, errors)
    # (The options given beyond the suite's own: a record made with them times something else
    # than the defaults, and the report keeps it apart.)
    record["mok_args"] = [a for extra in args.mok_arg for a in shlex.split(extra)]
    row["record"] = record
    try:
        row["path"] = records.write_record(record, args.results_dir)
    except (OSError, ValueError) as exc:
        # The GPU time is spent: the record is kept in the work directory (which stays), and the
        # run fails, saying where.
        saved = save_record_in_work(record, work)
        row["error"] = f"record not written ({exc}); {saved}"
        row["unsaved"] = True
        print(f"run.py: {row['error']}", file=sys.stderr, flush=True)
        return row
    print(f"record: {row['path']}", flush=True)
    # --no-peer with mok's check passing is what was asked for, not a failed run; its record
    # does not pass either (the summary says "no peer").
    mok_alone = not peer and record["check"]["mok"] is True and not errors
    if not record["check"]["passes"] and not row["error"] and not mok_alone:
        row["error"] = "check failed"
    row["ok"] = row["error"] is None
    if row["ok"] and not args.keep_work:
        remove_work(work, args.work_root)
    return row


class Interrupted(BaseException):
    """run.py got SIGINT (Ctrl-C) or SIGTERM: raised in the main thread by the signal handler
    (a BaseException, so the per-run `except Exception` does not take it for a failed run)."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self):
        return signal.Signals(self.signum).name

    @property
    def exit_code(self):
        return 128 + self.signum  # (130 for SIGINT, 143 for SIGTERM, as a shell reports them)


# How long a child stopped by a signal gets to exit before its process group is killed.
CHILD_STOP_GRACE_S = 10


def call_child(cmd):
    """subprocess.call(cmd), the child in a process group of its own (start_new_session), so that
    when run.py is interrupted (Interrupted: Ctrl-C, SIGTERM) the whole group is stopped: mok,
    `mok launch`'s ranks, the peer. A SIGTERM to run.py alone would otherwise leave them running,
    holding the GPU, and a Ctrl-C would reach them only from a terminal."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        mute_signals()  # (a second Ctrl-C must not cut the stopping short and leave the child running)
        # SIGTERM whichever signal run.py got: it ends a Python peer without a KeyboardInterrupt
        # traceback in the run's output, and mok and mok launch end on it as on Ctrl-C.
        stop_child(proc, signal.SIGTERM)
        raise


def stop_child(proc, signum):
    """Sends `signum` to `proc`'s process group, waits CHILD_STOP_GRACE_S for it, then kills the
    group (SIGKILL): nothing of the run is left holding the GPU."""
    for sig, grace in ((signum, CHILD_STOP_GRACE_S), (signal.SIGKILL, CHILD_STOP_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # (the group is gone already)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGKILL:
            return
        try:  # (the leader exited: its group's other members, e.g. a launcher's ranks, go too)
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def _ignore_further(signum, frame):
    pass  # (a second Ctrl-C while run.py stops the child and prints its summary)


def mute_signals():
    """From now on SIGINT and SIGTERM are ignored (main thread only; main restores the handlers
    it found when it returns)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _ignore_further)


def install_signal_handlers():
    """SIGINT and SIGTERM raise Interrupted in the main thread; returns the previous handlers
    (restore_signal_handlers), or None when not in the main thread (no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}


def restore_signal_handlers(previous):
    for sig, handler in (previous or {}).items():
        signal.signal(sig, handler)


def failed_peer(args, ep_mode, why):
    """The peer.json of a peer that left no usable verdict: failed, with the timing it was asked
    for (a run made to the contract that failed shows as FAIL in the report, rather than as
    off-contract behind an older passing record) and today's peer code (the record stands for
    the shape as today's FAIL)."""
    return {"check": {"passes": False}, "errors": {"peer": why},
            "peer_code": checks.peer_code("peer_dist" if ep_mode == "distributed" else "peer_torch"),
            "timing": {"warmup": args.warmup, "iters": args.iters, "ceiling_warmup": args.ceiling_warmup,
                       "ceiling_iters": args.ceiling_iters}}


RESCUED_RECORD = "record.json"


def save_record_in_work(record, work):
    """Saves a record that could not be written into the results folder as WORK/record.json
    (whole or not at all; the work directory is then kept); returns what to tell the user."""
    path = os.path.join(work, RESCUED_RECORD)
    try:
        records.write_json_atomic(path, record)
    except (OSError, ValueError) as exc:
        return f"saving it as {path} failed too ({type(exc).__name__}: {exc})"
    return (f"the record is saved as {path} and the work directory kept (import it with "
            f"`python3 bench/records.py import {path}` once the cause is fixed)")


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
            if r["error"] and (records.record_passes(rec) or r.get("unsaved")):
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
    """_main with SIGINT and SIGTERM turned into Interrupted (install_signal_handlers): during
    the runs, _main stops the child and prints the summary; before them (importing torch,
    say), nothing ran, and that is said in one line."""
    previous = install_signal_handlers()
    try:
        return _main(argv)
    except Interrupted as stop:
        print(f"run.py: interrupted by {stop.name} before any run started; nothing was run", file=sys.stderr)
        return stop.exit_code
    finally:
        restore_signal_handlers(previous)


def _main(argv=None):
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
    ap.add_argument("--mok-arg", action="append", default=[],
                    help="extra argument(s) for mok bench; repeatable; not one of the options run.py sets itself "
                         "(MOK_OPTIONS_RUN_PY_SETS: --shape, --tokens, --warmup, ...)")
    ap.add_argument("--work-root", default=os.path.join(BENCH_DIR, "work"))
    ap.add_argument("--results-dir", default=records.RESULTS_DIR)
    ap.add_argument("--keep-work", action="store_true", help="keep each work directory (large .npy files)")
    ap.add_argument("--no-backward", action="store_true", help="skip the peer's backward timing")
    ap.add_argument("--no-peer", action="store_true",
                    help="record mok alone (no PyTorch peer; mok bench writes no peer inputs)")
    ap.add_argument("--profile-peer", type=int, default=0, metavar="N",
                    help="profile N forwards of the PyTorch peer after all its timings (torch.profiler; in the "
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
    passes = repeats(args)
    per_pass = len(runs) // passes

    ok, what = cuda_status(args.assume_no_gpu)
    if not ok:
        print(f"run.py: no CUDA GPU: {what}.\n"
              f"The benchmarks run on a machine with an NVIDIA GPU and PyTorch (see bench/README.md);\n"
              f"`python3 bench/report.py` regenerates the report from existing records anywhere.",
              file=sys.stderr)
        return NO_GPU_EXIT
    mok_exe = shlex.split(args.mok_bin)[0] if args.mok_bin.strip() else ""  # (splits: option_errors)
    if not (shutil.which(mok_exe) or os.path.isfile(mok_exe)):
        print(f"run.py: the mok binary '{args.mok_bin}' does not exist; build it (cmake) or pass --mok-bin",
              file=sys.stderr)
        return 1
    for check in (results_dir_error, work_root_error):
        why = check(args.results_dir if check is results_dir_error else args.work_root)
        if why:  # (before any GPU time is spent on a record that could not be kept)
            print(f"run.py: {why}", file=sys.stderr)
            return 1
    print(f"run.py: GPU {what}")
    rows, current = [], None
    try:
        for i, (shape, mode, ep, tokens) in enumerate(runs):
            pass_index = i // per_pass if passes > 1 else None  # (plan_runs: the list once per pass)
            current = run_label(shape, mode, ep, tokens, pass_index)
            try:
                rows.append(run_one(args, shape, mode, ep, tokens, pass_index))
            except Exception as exc:  # keep going with the next run
                rows.append({"label": current, "shape": shape, "ok": False,
                             "error": f"{type(exc).__name__}: {exc}", "record": None})
            current = None
    except Interrupted as stop:
        # The child is stopped (call_child); the runs that finished are summed up, and the exit
        # says it was cut short. Further signals are ignored until the summary is out.
        mute_signals()
        if current is not None:
            rows.append({"label": current, "shape": current.split()[0], "ok": False,
                         "error": f"interrupted by {stop.name}", "record": None})
        print("\n" + passed_line(rows))
        print(summary_table(rows))
        written = [r["path"] for r in rows if r.get("path")]
        left = len(runs) - len(rows)
        print(f"run.py: interrupted by {stop.name}: {len(written)} record(s) written"
              + "".join(f"\n  {p}" for p in written)
              + (f"\n{current + ' was cut short (no record); ' if current else ''}{left} run(s) not started"
                 if left or current else ""), file=sys.stderr, flush=True)
        return stop.exit_code
    failed = [r for r in rows if not r["ok"]]
    print("\n" + passed_line(rows))
    print(summary_table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
