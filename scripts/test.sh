#!/usr/bin/env bash
# Quick start, command 2: set up, build, and run every test this machine can run: the C++
# suite (ctest; GPU tests skip with a message when no GPU is present) and the benchmark
# suite's CPU tests (record arithmetic, report generation) in a pinned Python venv.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
(cd build && ctest --output-on-failure -j2)
if [ ! -x .venv-bench/bin/python ]; then
  python3 -m venv .venv-bench
  .venv-bench/bin/pip install -q -r bench/requirements.txt
fi
.venv-bench/bin/python -m unittest discover -s bench/tests 2>&1 | tail -5
