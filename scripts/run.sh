#!/usr/bin/env bash
# The main job on one machine: build, bring the whole mesh up (six
# processes on loopback, model fetched on first use), answer one request
# through the OpenAI-compatible gateway, then stop the mesh.
#
#   bash scripts/run.sh ["your question"]        # answer, then stop
#   PDMESH_STAY=1 bash scripts/run.sh            # answer, then keep serving until Ctrl-C
#   PDMESH_JAEGER=1 PDMESH_STAY=1 bash scripts/run.sh
#       # also a local Jaeger (built once by scripts/gotool.sh jaeger): the answer's
#       # trace across all six services, in Jaeger's UI
set -euo pipefail
cd "$(dirname "$0")/.."
question=${1:-"What is the capital of France?"}
addr=${PDMESH_GATEWAY_ADDR:-127.0.0.1:8080}
state=$(mktemp -d)
bash scripts/deps.sh
cargo build --release --workspace --bins
tracing=()
if [ -n "${PDMESH_JAEGER:-}" ]; then
  tracing=(--jaeger --jaeger-bin "$(bash scripts/gotool.sh jaeger)" --trace-kernel-steps 1)
fi
./target/release/meshctl up --gateway-addr "$addr" --registry-dir "$state/registry" "${tracing[@]}" > "$state/up.out" &
mesh=$!
trap 'kill -TERM $mesh 2>/dev/null; wait $mesh 2>/dev/null; rm -rf "$state"' EXIT
until grep -q "pdmesh is up" "$state/up.out" 2>/dev/null; do
  kill -0 $mesh 2>/dev/null || { echo "meshctl up failed; logs in $state/logs" >&2; cat "$state"/logs/*.log >&2 || true; exit 1; }
  sleep 0.5
done
cat "$state/up.out"
./target/release/meshctl status --registry-dir "$state/registry"
echo
echo "POST http://$addr/v1/chat/completions: $question"
python3 - "$addr" "$question" <<'PY'
import json, sys, urllib.request
addr, q = sys.argv[1], sys.argv[2]
body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": q}], "max_tokens": 64, "temperature": 0}
req = urllib.request.Request(f"http://{addr}/v1/chat/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"})
resp = urllib.request.urlopen(req, timeout=300)
trace = resp.headers.get("x-pdmesh-trace-id")
r = json.load(resp)
print(r["choices"][0]["message"]["content"])
print(json.dumps({"finish_reason": r["choices"][0]["finish_reason"], "usage": r["usage"], "trace_id": trace}))
PY
ui=$(sed -n 's/^traces: \(http[^ ]*\).*/\1/p' "$state/up.out")
[ -n "$ui" ] && echo "its trace: $ui (service pdmesh-gateway; meshctl explain TRACE_ID --jaeger $ui)"
if [ -n "${PDMESH_STAY:-}" ]; then
  echo "serving on http://$addr/v1 until Ctrl-C"
  wait $mesh
fi
