#!/usr/bin/env bash
# libmok.so exports its public API and nothing else (cmake/libmok.map): every defined
# dynamic symbol is a C function of include/mok/c_api.h (mok_*), or a name of the mok
# namespace the public headers declare (mok::Layer::forward, mok::to_string, the type
# information of mok::Error), never an internal one (mok::cuda::..., mok::BackendImpl) or
# a header library's (cuda::std::..., std::...).
#   tests/install_exports.sh LIBMOK_SO
set -euo pipefail
lib=${1:?usage: tests/install_exports.sh LIBMOK_SO}
headers=$(cd "$(dirname "$0")/../include/mok" && pwd)
symbols=$(nm -D --defined-only "$lib" | awk '{print $3}')
[ -n "$symbols" ] || { echo "install_exports: $lib defines no dynamic symbols"; exit 1; }
bad=0
count=0
while IFS= read -r mangled; do
  count=$((count + 1))
  case "$mangled" in
    mok_*)
      grep -qw "$mangled" "$headers/c_api.h" || { echo "install_exports: $mangled is not in c_api.h"; bad=1; }
      continue ;;
    _Z*) ;;
    *) echo "install_exports: $mangled is exported and is not mok's API"; bad=1; continue ;;
  esac
  name=$(echo "$mangled" | c++filt)
  # The mok:: entity it belongs to: "typeinfo for mok::Error" -> Error,
  # "mok::Layer::forward(...)" -> Layer, "mok::to_string(mok::DType)" -> to_string.
  entity=$(echo "$name" | sed -E 's/^(typeinfo name for |typeinfo for |vtable for )//; s/\(.*//' |
           sed -nE 's/^mok::([A-Za-z_][A-Za-z0-9_]*).*/\1/p')
  if [ -z "$entity" ]; then
    echo "install_exports: '$name' is exported and is not in namespace mok"; bad=1
  elif [[ "$entity" =~ ^[a-z] ]] && [[ "$name" =~ ^mok::$entity:: ]]; then
    echo "install_exports: '$name' is exported from the internal namespace mok::$entity"; bad=1
  elif ! grep -qE "(struct|class) $entity\b|\b$entity\(" "$headers"/*.h; then
    echo "install_exports: '$name' is exported and mok::$entity is not declared in include/mok"; bad=1
  fi
done <<< "$symbols"
[ $bad = 0 ] || exit 1
echo "install_exports: ok ($count symbols, all public API)"
