#!/usr/bin/env bash
# cmake --install of a build into a fresh prefix, then tests/install_consumer built against
# that prefix alone (find_package(mok)) and run, and the installed mok CLI run.
#   tests/install_consumer.sh BUILD_DIR [CMAKE_ARGS...]   (CMAKE_ARGS: for the consumer's configure)
set -euo pipefail
build=$(realpath "${1:?usage: tests/install_consumer.sh BUILD_DIR [CMAKE_ARGS...]}")
shift
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/mok_install.XXXXXX")
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log" ||
  { cat "$work/install.log"; echo "install_consumer: cmake --install failed"; exit 1; }
for f in include/mok/mok.h include/mok/c_api.h lib/libmok.so bin/mok lib/cmake/mok/mokConfig.cmake; do
  [ -e "$work/prefix/$f" ] || { echo "install_consumer: the install has no $f"; exit 1; }
done
# (A generator of the consumer's own: whatever cmake picks, the install alone must do.)
cmake -S "$here/install_consumer" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Release "$@" > "$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; echo "install_consumer: find_package(mok) failed"; exit 1; }
cmake --build "$work/consumer" > "$work/build.log" 2>&1 ||
  { cat "$work/build.log"; echo "install_consumer: the consumer did not build"; exit 1; }
# (The consumer finds libmok.so through the RPATH CMake gives a build-tree binary.)
"$work/consumer/consumer"
"$work/prefix/bin/mok" --help > "$work/help.txt" 2>&1 ||
  { cat "$work/help.txt"; echo "install_consumer: the installed mok --help failed"; exit 1; }
grep -q "run the layer on a shape" "$work/help.txt" || { cat "$work/help.txt"; echo "install_consumer: unexpected mok --help"; exit 1; }
echo "install_consumer: ok"
