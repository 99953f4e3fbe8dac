#!/usr/bin/env python3
"""A stand-in for `nvidia-smi --query-gpu=... --format=csv,noheader,nounits [--loop-ms=N]`, for the
tests of gpu_clocks.py and run.py (TEST FIXTURE: its clocks and power are made up).

One line per GPU (FAKE_SMI_GPUS, default 1) per sample: timestamp (now, nvidia-smi's format),
index, clocks.sm 1410 (1300 on GPU 1), power 690.5 W, the SW power cap "Active", HW slowdown
"Not Active". Fields named in FAKE_SMI_MISSING (comma-separated) are refused the way
nvidia-smi refuses a field it does not know (exit 2 and a message), so that the callers'
fallbacks run. With --loop-ms=N it samples every N ms until terminated.
"""
import datetime
import os
import sys
import time

VALUES = {"index": lambda gpu: str(gpu), "clocks.sm": lambda gpu: "1300" if gpu == 1 else "1410",
          "power.draw": lambda gpu: "690.50", "power.draw.instant": lambda gpu: "690.50",
          "clocks_event_reasons.sw_power_cap": lambda gpu: "Active",
          "clocks_throttle_reasons.sw_power_cap": lambda gpu: "Active",
          "clocks_event_reasons.hw_slowdown": lambda gpu: "Not Active",
          "clocks_throttle_reasons.hw_slowdown": lambda gpu: "Not Active"}


def main(argv):
    fields, period_ms = None, None
    for a in argv:
        if a.startswith("--query-gpu="):
            fields = a.split("=", 1)[1].split(",")
        elif a.startswith("--loop-ms="):
            period_ms = int(a.split("=", 1)[1])
    missing = set(filter(None, os.environ.get("FAKE_SMI_MISSING", "").split(",")))
    if fields is None:
        print("fake nvidia-smi: only --query-gpu is emulated", file=sys.stderr)
        return 2
    for f in fields:
        if f in missing or (f != "timestamp" and f not in VALUES):
            print(f'Field "{f}" is not a valid field to query.', file=sys.stdout)
            return 2
    gpus = int(os.environ.get("FAKE_SMI_GPUS", "1"))
    while True:
        stamp = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        for gpu in range(gpus):
            cells = [stamp if f == "timestamp" else VALUES[f](gpu) for f in fields]
            sys.stdout.write(", ".join(cells) + "\n")
        sys.stdout.flush()
        if period_ms is None:
            return 0
        time.sleep(period_ms / 1000)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (KeyboardInterrupt, BrokenPipeError):
        sys.exit(0)
