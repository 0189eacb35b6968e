#!/usr/bin/env bash
# pdmesh's gateway against llama.cpp's llama-server on the same model and
# machine, in one pdmesh-loadtest invocation per workload, A/B interleaved
# (A, B, A, B ... at each load point): a closed-loop sweep at concurrency
# 1, 4, 16, 32, then a mix of agentic multi-turn sessions. Writes JSON,
# Markdown and plots under docs/benchmarks/.
#
#   scripts/bench_vs_llama_server.sh /path/to/llama-server [ROUNDS]
#
# Build llama-server outside this repository (../shared/BENCHMARKS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
llama=${1:?path of llama-server}
rounds=${2:-2}
bin=target/release
day=$(date +%F)
out=docs/benchmarks
model=$("$bin/pdmesh-engine" fetch 2>/dev/null | tail -1)
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT
# 32 slots of 1024 positions: enough for every agentic history below.
"$llama" -m "$model" --host 127.0.0.1 --port 18181 -t 2 -np 32 -cb -c 32768 >"$work/llama.log" 2>&1 &
"$bin/meshctl" up --gateway-addr 127.0.0.1:18180 --registry-dir "$work/registry" >"$work/up.log" 2>&1 &
for _ in $(seq 1 600); do grep -q "pdmesh is up" "$work/up.log" && break; sleep 0.5; done
for _ in $(seq 1 600); do curl -sf http://127.0.0.1:18181/health >/dev/null && break; sleep 0.5; done
common=(--target 127.0.0.1:18180 --target-b 127.0.0.1:18181 --label-a pdmesh --label-b llama-server
        --ab-rounds "$rounds" --registry-dir "$work/registry" --meshctl "$bin/meshctl" --seed 1)
set -x
"$bin/pdmesh-loadtest" "${common[@]}" --mode closed --concurrency 1,4,16,32 --requests 32 --max-tokens 64 --ignore-eos \
  --out "$out/loadtest-vs-llama-server-$day.json" --markdown "$out/loadtest-vs-llama-server-$day.md" --plots "$out/loadtest-vs-llama-server-$day"
"$bin/pdmesh-loadtest" "${common[@]}" --mode agentic --sessions 8 --rounds 3 --think-s 1 --max-tokens 48 --ignore-eos \
  --out "$out/loadtest-agentic-vs-llama-server-$day.json" --markdown "$out/loadtest-agentic-vs-llama-server-$day.md" --plots "$out/loadtest-agentic-vs-llama-server-$day"
# Raw per-request records are kept compressed (docs/benchmarks/README.md).
find "$out" -maxdepth 1 -name "*-$day*.json" -size +64k -exec xz -9f {} +
