#!/usr/bin/env bash
# Installs what the build needs (Debian packages) when missing, then configures and builds
# mok into build/ (CUDA sm_90a when nvcc exists). scripts/test.sh makes the pinned Python
# environment its tests use.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
# (make: the install check's consumer project builds with cmake's default generator.)
for pkg in cmake ninja-build make g++ libgtest-dev libgmock-dev python3-venv; do
  dpkg -s "$pkg" > /dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
# CMake 3.25 or newer (CMakeLists.txt): Debian 12 and Ubuntu 24.04 ship it, older releases do not.
cmake_version=$(cmake --version | sed -n '1s/[^0-9]*\([0-9][0-9.]*\).*/\1/p')
if [ "$(printf '%s\n' 3.25 "$cmake_version" | sort -V | head -1)" != 3.25 ]; then
  echo "setup: CMake $cmake_version is older than 3.25, which mok needs (Debian 12 or Ubuntu 24.04 and newer" \
       "ship it; elsewhere install a newer CMake first)"
  exit 1
fi
if ! command -v nvcc > /dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
# A build/ configured before nvcc was installed keeps "no CUDA compiler" in its cache: look
# again now that there is one.
recheck_cuda=()
if command -v nvcc > /dev/null && grep -qE '^CMAKE_CUDA_COMPILER:[A-Z]+=.*NOTFOUND' build/CMakeCache.txt 2> /dev/null; then
  recheck_cuda=(-UCMAKE_CUDA_COMPILER)
fi
# MOK_REQUIRE_CUDA=1 (CI sets it): no nvcc is an error rather than a build without the CUDA backend.
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_REQUIRE_CUDA="${MOK_REQUIRE_CUDA:-0}" \
  ${recheck_cuda[@]+"${recheck_cuda[@]}"} > build.log 2>&1 ||
  { cat build.log; exit 1; }
grep -E "mok: CUDA backend" build.log || true
ninja -C build >> build.log 2>&1 || { tail -50 build.log; exit 1; }
echo "setup: built build/bin/mok"
