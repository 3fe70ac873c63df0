#!/usr/bin/env bash
# Builds keel's libFuzzer targets with clang into BUILD_DIR and runs each for SECONDS seconds,
# starting from the checked-in corpus (copied, so the tree is never written to).
#   scripts/fuzz.sh BUILD_DIR SECONDS
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:?usage: fuzz.sh BUILD_DIR SECONDS}
seconds=${2:?usage: fuzz.sh BUILD_DIR SECONDS}
command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ is not installed" >&2; exit 1; }
cmake -S "$root/fuzz" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ >/dev/null
cmake --build "$build" >/dev/null
# json_check gets longer inputs: its corpus holds deep-nesting seeds.
for target in retry_after duration deadline_header json_check url header_arg response_head database_url idempotency_key explorer_query; do
  max_len=256
  if [ "$target" = json_check ]; then max_len=8192; fi
  corpus="$build/corpus-$target"
  mkdir -p "$corpus"
  cp -n "$root/fuzz/corpus/$target/"* "$corpus/" 2>/dev/null || true
  echo "fuzzing $target for ${seconds}s"
  "$build/fuzz_$target" -max_total_time="$seconds" -max_len="$max_len" -print_final_stats=1 \
    "$corpus" 2>&1 | tail -n 4
  test "${PIPESTATUS[0]}" -eq 0
done
