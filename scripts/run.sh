#!/usr/bin/env bash
# Quick start, command 1: set up, build, and run mok's main job on its default shape
# (the CUDA backend on a Hopper GPU, else the CPU reference on a small shape).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec build/bin/mok "$@"
