#!/usr/bin/env bash
# Quick start, command 2: set up, build, and run every test this machine can run: the C++
# suite (ctest; GPU tests skip with a message when no GPU is present), the megakernel's SASS
# checks (scripts/check_sass.sh), the benchmark suite's CPU tests (record arithmetic, report
# generation) and the Python binding's (python/mok) in a pinned Python venv.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
(cd build && ctest --output-on-failure -j2)
# The megakernel's machine code (wgmmas present, no spills, the setmaxnreg budget): no GPU
# needed. Exit 3: mok was built without the CUDA backend (no nvcc here), nothing to check.
rc=0; scripts/check_sass.sh build/bin build/sass || rc=$?
[ $rc = 0 ] || [ $rc = 3 ] || exit 1
if [ ! -x .venv-bench/bin/python ]; then
  python3 -m venv .venv-bench
  .venv-bench/bin/pip install -q -r bench/requirements.txt
fi
.venv-bench/bin/python -m unittest discover -s bench/tests 2>&1 | tail -5
# python/mok, the binding through build/lib/libmok.so, on the CPU backend with numpy; its
# PyTorch CUDA test skips here, saying why (scripts/device_check.sh runs it on a GPU).
MOK_LIBRARY=build/lib/libmok.so .venv-bench/bin/python -m unittest discover -s python/tests -v 2>&1 | tail -4
