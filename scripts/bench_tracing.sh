#!/usr/bin/env bash
# Tracing overhead: throughput at concurrency 16 with tracing off and with
# every request traced (100% sampling, exported to `meshctl collect`), run
# alternately on the same machine; odd rounds run off first, even rounds on
# first, so neither setting always gets the first (cold) slot.
# Usage: scripts/bench_tracing.sh [ROUNDS] [OUT.json]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
out=${2:-docs/benchmarks/tracing-overhead-$(date +%F).json}
bin=target/release
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
"$bin/meshctl" collect --listen 127.0.0.1:14317 --out "$work/traces.jsonl" 2>"$work/collect.log" &
results=()
for r in $(seq 1 "$rounds"); do
  order="off on"; [ $((r % 2)) -eq 0 ] && order="on off"
  for mode in $order; do
    reg="$work/reg-$mode-$r"
    flags=()
    [ "$mode" = on ] && flags=(--otlp-endpoint http://127.0.0.1:14317 --trace-sample-ratio 1.0)
    "$bin/meshctl" up --gateway-addr 127.0.0.1:18089 --registry-dir "$reg" "${flags[@]}" >"$work/up.log" 2>&1 &
    up=$!
    for _ in $(seq 1 600); do grep -q "pdmesh is up" "$work/up.log" && break; sleep 0.5; done
    res=$("$bin/pdmesh-bench" mesh --mesh-only --concurrency 16 --requests 48 --max-tokens 64 --registry-dir "$reg")
    echo "round $r tracing $mode: $res" >&2
    results+=("{\"round\":$r,\"tracing\":\"$mode\",\"bench\":$res}")
    kill -TERM "$up"; wait "$up" || true
  done
done
spans=$(wc -l <"$work/traces.jsonl")
printf '{"command":"scripts/bench_tracing.sh %s","export_lines":%s,"runs":[%s]}\n' "$rounds" "$spans" "$(IFS=,; echo "${results[*]}")" >"$out"
echo "wrote $out" >&2
