#!/usr/bin/env bash
# pip install of this checkout (pyproject.toml; CPU-only, for speed: the CUDA build is the
# same CMake) into a fresh venv, then the binding's CPU tests (python/tests/test_binding.py)
# against that installed package and its own libmok.so, the installed mok command, and an
# editable install (pip install -e .) loading its own libmok.so.
# Needs the package index (scikit-build-core, what it pulls in, and numpy: pinned).
#   tests/install_python.sh
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d "${TMPDIR:-/tmp}/mok_pip.XXXXXX")
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
# (The isolated build environment's pip reads the constraints from the environment too.)
export PIP_CONSTRAINT="$PWD/python/build-constraints.txt"
numpy_pin=$(grep -E '^numpy==' bench/requirements.txt)
"$work/venv/bin/pip" install -q "$numpy_pin" > "$work/pip.log" 2>&1 &&
  "$work/venv/bin/pip" install -q -C cmake.define.MOK_WITH_CUDA=OFF . >> "$work/pip.log" 2>&1 ||
  { cat "$work/pip.log"; echo "install_python: pip install failed"; exit 1; }
"$work/venv/bin/mok" shapes > "$work/shapes.txt" 2>&1 && grep -q "qwen3.5-397b-a17b" "$work/shapes.txt" ||
  { cat "$work/shapes.txt"; echo "install_python: the installed mok command failed"; exit 1; }
# (From outside the checkout, so that `import mok` cannot find its python/.)
(cd "$work" && MOK_TEST_INSTALLED=1 "$work/venv/bin/python" -m unittest discover -s "$OLDPWD/python/tests" \
  -p test_binding.py > "$work/tests.log" 2>&1) || { cat "$work/tests.log"; echo "install_python: FAILED"; exit 1; }
# An editable install (pip install -e .) keeps the module in the checkout and its libmok.so in
# site-packages: that library, not a checkout's build, is the one loaded.
"$work/venv/bin/pip" uninstall -q -y mok >> "$work/pip.log" 2>&1
"$work/venv/bin/pip" install -q -C cmake.define.MOK_WITH_CUDA=OFF -e . >> "$work/pip.log" 2>&1 ||
  { cat "$work/pip.log"; echo "install_python: pip install -e failed"; exit 1; }
(cd "$work" && "$work/venv/bin/python" -c '
import sys, mok
assert mok.library_path().startswith(sys.prefix), f"pip install -e: mok loads {mok.library_path()}, not its own"
assert mok.Problem.from_shape("tiny").top_k > 0
') || { echo "install_python: the editable install does not load its own library"; exit 1; }
echo "install_python: ok (pip install . and python/tests/test_binding.py against it: $(tail -1 "$work/tests.log");" \
     "pip install -e . loads its own libmok.so)"
