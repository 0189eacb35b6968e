#!/usr/bin/env bash
# Replicas on one host (issue 42): the same closed-loop load against
# meshes of 1 and 2 decode workers and 1 and 2 prefill workers, each
# brought up fresh, rounds interleaved (1, 2, 1, 2 ...). Prints one JSON
# line per run: the mesh's flags, output tok/s, e2e p50/p99, TTFT p90,
# inter-token p99, failed.
#
#   bash scripts/bench_replicas.sh [ROUNDS] [EXTRA MESHCTL FLAGS...]
#   PDMESH_BENCH_CLIENTS=8 PDMESH_BENCH_REQUESTS=48 PDMESH_BENCH_TOKENS=48 (defaults)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-1}
shift || true
extra=("$@")
clients=${PDMESH_BENCH_CLIENTS:-8}
requests=${PDMESH_BENCH_REQUESTS:-48}
tokens=${PDMESH_BENCH_TOKENS:-48}
configs=${PDMESH_BENCH_CONFIGS:-"decode=1 decode=2 prefill=1 prefill=2"}
cargo build --release --workspace --bins >&2
bin=target/release
run_one() {
  local kind=${1%=*} n=${1#*=}
  local state addr mesh
  state=$(mktemp -d)
  addr=127.0.0.1:$((20000 + RANDOM % 20000))
  "$bin/meshctl" up --gateway-addr "$addr" --registry-dir "$state/registry" \
    "--$kind-replicas" "$n" "${extra[@]}" > "$state/up.out" 2> "$state/up.err" &
  mesh=$!
  until grep -q "pdmesh is up" "$state/up.out" 2>/dev/null; do
    kill -0 $mesh 2>/dev/null || { cat "$state/up.err" >&2; exit 1; }
    sleep 0.5
  done
  # A short warm-up, so each worker has seen its step shapes.
  "$bin/pdmesh-loadtest" --target "$addr" --concurrency "$clients" --requests "$clients" \
    --max-tokens 8 --ignore-eos --out /dev/null --markdown /dev/null 2>/dev/null
  "$bin/pdmesh-loadtest" --target "$addr" --concurrency "$clients" --requests "$requests" \
    --max-tokens "$tokens" --ignore-eos --out "$state/run.json" --markdown /dev/null 2>/dev/null
  kill -TERM $mesh; wait $mesh 2>/dev/null || true
  python3 - "$state/run.json" "$kind" "$n" "${extra[*]}" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
points = doc["points"] if isinstance(doc, dict) and "points" in doc else doc
p = points[0] if isinstance(points, list) else points
f = lambda k, q: round(p[k][q], 3) if p.get(k) else None
print(json.dumps({"replicas": {sys.argv[2]: int(sys.argv[3])}, "flags": sys.argv[4],
  "clients": p["concurrency"], "requests": p["requests"], "failed": p["errors"] + p["stalled"],
  "output_tok_s": round(p["output_tokens_per_s"], 1),
  "e2e_s": {"p50": f("e2e_s", "p50"), "p99": f("e2e_s", "p99")},
  "ttft_p90_s": f("ttft_s", "p90"), "inter_token_p99_s": f("inter_token_s", "p99")}))
PY
  rm -rf "$state"
}
for _ in $(seq "$rounds"); do
  for c in $configs; do run_one "$c"; done
done
