#!/usr/bin/env bash
# pip install of this checkout (pyproject.toml; CPU-only, for speed: the CUDA build is the
# same CMake) into a fresh venv, then the binding's CPU tests (python/tests/test_binding.py)
# against that installed package and its own libmok.so, and the installed mok command.
# Needs the package index (scikit-build-core and numpy, pinned).
#   tests/install_python.sh
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d "${TMPDIR:-/tmp}/mok_pip.XXXXXX")
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
numpy_pin=$(grep -E '^numpy==' bench/requirements.txt)
"$work/venv/bin/pip" install -q "$numpy_pin" > "$work/pip.log" 2>&1 &&
  "$work/venv/bin/pip" install -q -C cmake.define.MOK_WITH_CUDA=OFF . >> "$work/pip.log" 2>&1 ||
  { cat "$work/pip.log"; echo "install_python: pip install failed"; exit 1; }
"$work/venv/bin/mok" shapes > "$work/shapes.txt" 2>&1 && grep -q "qwen3.5-397b-a17b" "$work/shapes.txt" ||
  { cat "$work/shapes.txt"; echo "install_python: the installed mok command failed"; exit 1; }
# (From outside the checkout, so that `import mok` cannot find its python/.)
(cd "$work" && MOK_TEST_INSTALLED=1 "$work/venv/bin/python" -m unittest discover -s "$OLDPWD/python/tests" \
  -p test_binding.py > "$work/tests.log" 2>&1) || { cat "$work/tests.log"; echo "install_python: FAILED"; exit 1; }
echo "install_python: ok (pip install . and python/tests/test_binding.py against it: $(tail -1 "$work/tests.log"))"
