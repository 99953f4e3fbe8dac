"""Shared bits of the CPU tests of bench/ (no torch anywhere)."""
import json
import os
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
BENCH_DIR = os.path.dirname(TESTS_DIR)
FIXTURES = os.path.join(TESTS_DIR, "fixtures")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)


def fixture(name):
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


def env(date="2001-02-03T04:05:06Z", sha="0123456789abcdef0123456789abcdef01234567"):
    return {"date": date, "commit": {"sha": sha, "dirty": False, "source": "test"}}


def read_text(path):
    with open(path) as f:
        return f.read()


def read_json(path):
    with open(path) as f:
        return json.load(f)


def set_median(entry, ms):
    """Sets a timed entry's median_ms to `ms`, scaling its min_ms and max_ms with it: a record
    keeps min_ms <= median_ms <= max_ms (records.load_record refuses one that does not)."""
    old = entry["median_ms"]
    for key in ("min_ms", "max_ms"):
        if entry.get(key) is not None:
            entry[key] = entry[key] * ms / old
    entry["median_ms"] = ms
