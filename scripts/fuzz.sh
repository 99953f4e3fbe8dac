#!/usr/bin/env bash
# Runs mok's fuzz targets (tests/fuzz: the .npy reader, the problem.json parser) under
# libFuzzer with AddressSanitizer and UndefinedBehaviorSanitizer, SECONDS each (default 60),
# from the inputs in tests/fuzz/inputs (a working corpus grows under build-fuzz/corpus).
# A finding is saved under build-fuzz/findings/<target>/ and fails the script: copy it into
# tests/fuzz/inputs/<kind>/ once fixed, where ctest's fuzz_replay.* tests replay it.
#
#   scripts/fuzz.sh [SECONDS]
#
# Needs clang (Debian's clang package, with its libFuzzer runtime); no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
each=${1:-60}
[[ "$each" =~ ^[0-9]+$ ]] && [ "$each" -gt 0 ] || { echo "fuzz: SECONDS must be a positive integer, got '$each'"; exit 2; }
command -v clang++ > /dev/null || { echo "fuzz: clang++ is needed (Debian: apt-get install clang)"; exit 1; }
flags="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
  -DMOK_WITH_CUDA=OFF -DMOK_NATIVE=OFF -DMOK_FUZZ=ON "-DCMAKE_CXX_FLAGS=$flags" > build-fuzz.log 2>&1 ||
  { cat build-fuzz.log; exit 1; }
ninja -C build-fuzz mok_fuzz_npy mok_fuzz_problem_json >> build-fuzz.log 2>&1 || { tail -40 build-fuzz.log; exit 1; }
failed=0
for pair in npy:npy problem_json:json; do
  target=${pair%%:*} kind=${pair##*:}
  corpus=build-fuzz/corpus/$target findings=build-fuzz/findings/$target
  mkdir -p "$corpus" "$findings"
  log=build-fuzz/fuzz_$target.log
  # (The .npy target writes each input to a file: /dev/shm keeps that off the disk.)
  if TMPDIR=$([ -d /dev/shm ] && echo /dev/shm || echo /tmp) build-fuzz/bin/mok_fuzz_$target "$corpus" \
       "tests/fuzz/inputs/$kind" -dict="tests/fuzz/$kind.dict" -max_total_time="$each" -rss_limit_mb=2048 \
       -malloc_limit_mb=2048 -timeout=10 -max_len=4096 -artifact_prefix="$findings/" > "$log" 2>&1; then
    echo "fuzz: $target: $(grep -E '^Done [0-9]+ runs' "$log" | tail -1)"
  else
    failed=1
    echo "fuzz: $target FOUND something: $(ls "$findings" | head -3 | tr '\n' ' ')(log: $log)"
    grep -E "ERROR|SUMMARY|escaped|round trip|abort" "$log" | head -5
  fi
done
exit $failed
