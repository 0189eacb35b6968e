#!/usr/bin/env bash
# Runs one test of the workspace N times in a row, each with its own
# timeout, and prints one JSON line per run and a summary: the tool for "a
# test that fails once in a while". A failed run's output is kept.
#
#   bash scripts/repeat-test.sh TEST_BINARY TEST_NAME [N] [TIMEOUT_S]
#   bash scripts/repeat-test.sh prefix with_no_prefill_worker_left_the_decode_worker_prefills_any_prompt 20 120
#   bash scripts/repeat-test.sh prefix all 20 900     (every test of the binary)
#
# The timeout is far below the test client's own (300 s), so a hang shows
# as "timeout" quickly, with the mesh's logs kept under $TMPDIR.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:?usage: repeat-test.sh TEST_BINARY TEST_NAME [N] [TIMEOUT_S]}
name=${2:?usage: repeat-test.sh TEST_BINARY TEST_NAME [N] [TIMEOUT_S]}
n=${3:-20}
limit=${4:-120}
cargo build --release --workspace --all-targets >&2
out=$(mktemp -d "${TMPDIR:-/tmp}/pdmesh-repeat.XXXXXX")
pass=0
fail=0
for i in $(seq 1 "$n"); do
  t0=$(date +%s.%N)
  set +e
  filter=(--exact "$name"); [ "$name" = all ] && filter=()
  timeout "$limit" cargo test --release --workspace --test "$bin" -- "${filter[@]}" --nocapture > "$out/run-$i.log" 2>&1
  rc=$?
  set -e
  t=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
  case $rc in
    0) verdict=pass; pass=$((pass + 1)); rm -f "$out/run-$i.log" ;;
    124) verdict=timeout; fail=$((fail + 1)) ;;
    *) verdict=fail; fail=$((fail + 1)) ;;
  esac
  log=""; [ "$verdict" = pass ] || log="$out/run-$i.log"
  printf '{"run": %d, "verdict": "%s", "seconds": %s, "log": "%s"}\n' "$i" "$verdict" "$t" "$log"
done
printf '{"test": "%s::%s", "runs": %d, "passed": %d, "failed": %d, "logs": "%s"}\n' "$bin" "$name" "$n" "$pass" "$fail" "$out"
[ "$fail" -eq 0 ]
