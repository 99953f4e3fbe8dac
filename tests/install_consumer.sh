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
# The library's SONAME carries the ABI's version (CMakeLists.txt), the file it names is installed,
# and libmok.so (what a link finds) leads to it.
version=$(sed -nE 's/^project\(mok LANGUAGES CXX VERSION ([0-9]+)\.([0-9]+)\.[0-9]+\)$/\1.\2/p' "$here/../CMakeLists.txt")
[ -n "$version" ] || { echo "install_consumer: no project version in CMakeLists.txt"; exit 1; }
soname=$(readelf -d "$work/prefix/lib/libmok.so" | sed -nE 's/.*\(SONAME\).*\[(.*)\]/\1/p')
[ "$soname" = "libmok.so.$version" ] ||
  { echo "install_consumer: libmok.so's SONAME is '$soname', not libmok.so.$version"; exit 1; }
[ -f "$work/prefix/lib/$soname" ] || { echo "install_consumer: the install has no lib/$soname"; exit 1; }
[ "$(realpath "$work/prefix/lib/libmok.so")" = "$(realpath "$work/prefix/lib/$soname")" ] ||
  { echo "install_consumer: lib/libmok.so is not lib/$soname"; exit 1; }
# (A generator of the consumer's own: whatever cmake picks, the install alone must do.)
cmake -S "$here/install_consumer" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Release "$@" > "$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; echo "install_consumer: find_package(mok) failed"; exit 1; }
cmake --build "$work/consumer" > "$work/build.log" 2>&1 ||
  { cat "$work/build.log"; echo "install_consumer: the consumer did not build"; exit 1; }
# (The consumer finds libmok.so through the RPATH CMake gives a build-tree binary.)
"$work/consumer/consumer"
# (It needs the versioned name, not the bare one a newer release would take over.)
readelf -d "$work/consumer/consumer" | grep "(NEEDED)" | grep -qF "[$soname]" ||
  { readelf -d "$work/consumer/consumer" | grep NEEDED; echo "install_consumer: the consumer does not need $soname"; exit 1; }
"$work/prefix/bin/mok" --help > "$work/help.txt" 2>&1 ||
  { cat "$work/help.txt"; echo "install_consumer: the installed mok --help failed"; exit 1; }
grep -q "run the layer on a shape" "$work/help.txt" || { cat "$work/help.txt"; echo "install_consumer: unexpected mok --help"; exit 1; }
echo "install_consumer: ok"
