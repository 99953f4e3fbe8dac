#!/usr/bin/env python3
"""A stand-in for `mok bench`, for tests of run.py only (TEST FIXTURE, never a result).

Accepts the command line run.py gives `mok bench` and writes a small synthetic work
directory (synth_workdir.py) whatever the shape: the shape name is kept, the sizes are not.
    fake_mok.py bench --shape S --ep-mode M --ep R --tokens T --routing X
                      --warmup W --iters N --work-dir DIR [--no-peer-inputs]
                      [other options ignored]
    fake_mok.py launch -n N [--timeout S] -- CMD...   runs CMD once per rank, one after the
                      other, with MOK_RANK / MOK_WORLD_SIZE / MOK_LOCAL_RANK set (as mok launch)
With --ep-mode distributed it writes WORK_DIR/rank<MOK_RANK>, with per-iteration times
forward_ms * (1 + rank / 10), so the slowest rank is the last one.
Set FAKE_MOK_FAIL_SHAPE=S to make it fail (exit 3, no mok.json) for shape S, and
FAKE_MOK_CHECK_FAIL_SHAPE=S to make its check fail (mok.json written, passes false, exit 3),
FAKE_MOK_EXIT_SHAPE=S to make it exit 4 after writing a passing mok.json (a crash after the
JSON), FAKE_MOK_HANG_SHAPE=S to make it write its pid to WORK_DIR/fake_mok.pid and sleep 600 s
(a run that hangs), and FAKE_MOK_BUILD_COMMIT=SHA to stamp mok.json's "build" as a real binary does.
Its "timed loop" is a sleep of FAKE_MOK_TIMED_S seconds (default 0), whose Unix times it
writes as timing.window_unix_s, as `mok bench` writes its timed loop's.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from synth_workdir import make_workdir  # noqa: E402


def launch(argv):
    import subprocess
    ap = argparse.ArgumentParser(prog="fake_mok launch")
    ap.add_argument("-n", type=int, required=True)
    ap.add_argument("--timeout", type=float)
    split = argv.index("--")
    args = ap.parse_args(argv[:split])
    for r in range(args.n):
        env = dict(os.environ, MOK_RANK=str(r), MOK_WORLD_SIZE=str(args.n), MOK_LOCAL_RANK=str(r))
        rc = subprocess.call(argv[split + 1:], env=env)
        if rc != 0:
            print(f"fake_mok launch: rank {r} exited {rc}", file=sys.stderr)
            return rc
    return 0


def main(argv):
    if argv and argv[0] == "launch":
        return launch(argv[1:])
    if not argv or argv[0] != "bench":
        print("fake_mok: only the 'bench' command is emulated", file=sys.stderr)
        return 1
    ap = argparse.ArgumentParser(prog="fake_mok bench")
    ap.add_argument("--shape", required=True)
    ap.add_argument("--ep-mode", default="all")
    ap.add_argument("--ep", type=int)
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--routing", default="gaussian")
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--iters", type=int, default=1)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--no-peer-inputs", action="store_true")
    args, _ = ap.parse_known_args(argv[1:])
    if os.environ.get("FAKE_MOK_FAIL_SHAPE") == args.shape:
        print(f"fake_mok: failing on purpose for shape {args.shape}", file=sys.stderr)
        return 3
    if os.environ.get("FAKE_MOK_HANG_SHAPE") == args.shape:
        # A mok bench that never ends (a test stops run.py meanwhile): says its pid, then waits.
        os.makedirs(args.work_dir, exist_ok=True)
        with open(os.path.join(args.work_dir, "fake_mok.pid.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.path.join(args.work_dir, "fake_mok.pid.tmp"), os.path.join(args.work_dir, "fake_mok.pid"))
        time.sleep(600)
        return 5
    timed_start = time.time()
    time.sleep(float(os.environ.get("FAKE_MOK_TIMED_S", "0")))
    window = [timed_start, time.time()]
    tokens = min(args.tokens or 64, 256)
    work_dir, rank = args.work_dir, None
    if args.ep_mode == "distributed":
        rank = int(os.environ["MOK_RANK"])
        work_dir = os.path.join(args.work_dir, f"rank{rank}")
    make_workdir(work_dir, shape=args.shape, ep_mode=args.ep_mode, tokens=tokens, routing=args.routing,
                 warmup=args.warmup, iters=args.iters, forward_ms=0.5, backward_ms=1.0)
    path = os.path.join(work_dir, "mok.json")
    with open(path) as f:
        doc = json.load(f)
    doc["timing"]["window_unix_s"] = window
    if rank is not None:
        doc["forward_iters_ms"] = [0.5 * (1 + rank / 10) + 0.01 * i for i in range(args.iters)]
        doc["active_rank"] = rank
    check_fails = os.environ.get("FAKE_MOK_CHECK_FAIL_SHAPE") == args.shape
    if check_fails:
        doc["check"]["forward"].update({"max_abs": 9.0, "rel": 0.5, "passes": False})
    if args.no_peer_inputs:  # mok.json alone, as mok bench --no-peer-inputs writes
        doc["peer_inputs"] = False
        for name in os.listdir(work_dir):
            if name.endswith(".npy"):
                os.remove(os.path.join(work_dir, name))
    if os.environ.get("FAKE_MOK_BUILD_COMMIT"):
        doc["build"] = {"commit": os.environ["FAKE_MOK_BUILD_COMMIT"], "dirty": False}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    if check_fails:
        print("fake_mok: check FAILED (on purpose)", file=sys.stderr)
        return 3
    if os.environ.get("FAKE_MOK_EXIT_SHAPE") == args.shape:
        print("fake_mok: exiting 4 after writing mok.json (on purpose)", file=sys.stderr)
        return 4
    print(f"fake_mok: wrote {work_dir}/mok.json (synthetic)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
