#!/usr/bin/env bash
# The host code under AddressSanitizer and UndefinedBehaviorSanitizer: a CPU-only build in
# build-asan/ (the CPU reference, the CLI, the schedule and plan logic, file I/O) and every
# ctest test on it. Any report fails the run (leaks included). GPU code is checked by
# compute-sanitizer on the device instead (scripts/device_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOK_WITH_CUDA=OFF -DMOK_NATIVE=OFF \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" > build-asan.log 2>&1 ||
  { cat build-asan.log; exit 1; }
ninja -C build-asan >> build-asan.log 2>&1 || { tail -50 build-asan.log; exit 1; }
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# The full log only when something failed (a sanitizer report is in the failing test's output).
(cd build-asan && ctest --output-on-failure -j2 > ../build-asan-test.log 2>&1) || { cat build-asan-test.log; exit 1; }
tail -3 build-asan-test.log
# The Python binding's CPU tests through this build's libmok.so: the C interface as ctypes
# drives it (structs filled field by field from numpy). The sanitizer runtimes are preloaded
# into the uninstrumented interpreter; leak checking is off there (CPython keeps objects to
# its exit), on everywhere above.
if [ -x .venv-bench/bin/python ]; then
  preload="$(${CXX:-g++} -print-file-name=libasan.so):$(${CXX:-g++} -print-file-name=libubsan.so)"
  LD_PRELOAD="$preload" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 MOK_LIBRARY=build-asan/lib/libmok.so \
    .venv-bench/bin/python -m unittest discover -s python/tests > build-asan-python.log 2>&1 ||
    { cat build-asan-python.log; exit 1; }
  echo "python binding under the sanitizers: $(grep -E '^Ran|^OK' build-asan-python.log | tr '\n' ' ')"
else
  echo "python binding under the sanitizers: skipped, no .venv-bench (scripts/test.sh makes it)"
fi
echo "host sanitizers: clean"
