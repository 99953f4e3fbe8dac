#!/usr/bin/env bash
# Quick start, command 2: set up, build, and run every test this machine can run: the C++
# suite (ctest; GPU tests skip with a message when no GPU is present), the megakernel's SASS
# checks (scripts/check_sass.sh), the benchmark suite's CPU tests (record arithmetic, report
# generation) and the Python binding's (python/mok) in a pinned Python venv, also as
# installed by `pip install .` (tests/install_python.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The pinned test environments (numpy 2.4.6) need Python 3.11 or newer.
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
  { echo "test: $(python3 --version 2>&1) is older than 3.11, which the pinned test environments need" \
         "(Debian 12 and Ubuntu 24.04 ship 3.11 and 3.12)"; exit 1; }
(cd build && ctest --output-on-failure -j2 | tee ctest.log)
# (One line per skipped test: ctest lists each again under "did not run", not counted twice.)
skipped=$(grep -c "\*\*\*Skipped" build/ctest.log || true)
if [ "$skipped" -gt 0 ]; then
  echo "test: $skipped C++ test(s) skipped: they need a GPU (or NCCL on one) and this machine has none usable;" \
       "scripts/device_check.sh runs them on a GPU"
fi
# The megakernel's machine code (wgmmas present, no spills, the setmaxnreg budget): no GPU
# needed. Exit 3: mok was built without the CUDA backend (no nvcc here), nothing to check.
# (Under MOK_REQUIRE_CUDA=1, as in CI, a build without device code is a failure too.)
rc=0; scripts/check_sass.sh build/bin build/sass || rc=$?
[ $rc = 0 ] || { [ $rc = 3 ] && [ "${MOK_REQUIRE_CUDA:-0}" != 1 ]; } || exit 1
# The venv holds exactly bench/requirements.txt's pins, or is made again (a failed install, or
# pins changed since, would otherwise stay).
if ! cmp -s bench/requirements.txt .venv-bench/installed-requirements.txt; then
  rm -rf .venv-bench
  python3 -m venv .venv-bench
  .venv-bench/bin/pip install -q -r bench/requirements.txt
  cp bench/requirements.txt .venv-bench/installed-requirements.txt
fi
# A suite's skips are listed with their reasons; a failing suite prints its whole log.
unittests() {  # NAME LOG ARGS...: python -m unittest ARGS in the venv
  local name=$1 log=$2; shift 2
  if ! .venv-bench/bin/python -m unittest "$@" -v > "$log" 2>&1; then
    cat "$log"; echo "test: $name FAILED"; return 1
  fi
  grep -E " \.\.\. skipped" "$log" || true
  echo "test: $name: $(tail -1 "$log")"
}
unittests "bench/tests" build/bench_tests.log discover -s bench/tests
# python/mok, the binding through build/lib/libmok.so, on the CPU backend with numpy; its
# PyTorch CUDA test skips here, saying why (scripts/device_check.sh runs it on a GPU).
MOK_LIBRARY=build/lib/libmok.so unittests "python/tests" build/python_tests.log discover -s python/tests
# pip install . into a fresh venv (CPU-only) and the binding's tests against that package.
tests/install_python.sh
echo "test: every suite passed"
