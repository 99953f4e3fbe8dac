#!/usr/bin/env bash
# Installs what the build needs (Debian packages) when missing, then configures and builds
# mok into build/ (CUDA sm_90a when nvcc exists). scripts/test.sh makes the pinned Python
# environment its tests use.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
for pkg in cmake ninja-build g++ libgtest-dev libgmock-dev python3-venv; do
  dpkg -s "$pkg" > /dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
if ! command -v nvcc > /dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
# MOK_REQUIRE_CUDA=1 (CI sets it): no nvcc is an error rather than a build without the CUDA backend.
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_REQUIRE_CUDA="${MOK_REQUIRE_CUDA:-0}" > build.log 2>&1 ||
  { cat build.log; exit 1; }
grep -E "mok: CUDA backend" build.log || true
ninja -C build >> build.log 2>&1 || { tail -50 build.log; exit 1; }
echo "setup: built build/bin/mok"
