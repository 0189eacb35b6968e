#!/usr/bin/env bash
# The main job on one machine: build, bring the whole mesh up (six
# processes on loopback, model fetched on first use), answer one request
# through the OpenAI-compatible gateway, then stop the mesh.
#
#   bash scripts/run.sh ["your question"]        # answer, then stop
#   PDMESH_STAY=1 bash scripts/run.sh            # answer, then keep serving until Ctrl-C
set -euo pipefail
cd "$(dirname "$0")/.."
question=${1:-"What is the capital of France?"}
addr=${PDMESH_GATEWAY_ADDR:-127.0.0.1:8080}
state=$(mktemp -d)
bash scripts/deps.sh
cargo build --release --workspace --bins
./target/release/meshctl up --gateway-addr "$addr" --registry-dir "$state/registry" > "$state/up.out" &
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
r = json.load(urllib.request.urlopen(req, timeout=300))
print(r["choices"][0]["message"]["content"])
print(json.dumps({"finish_reason": r["choices"][0]["finish_reason"], "usage": r["usage"]}))
PY
if [ -n "${PDMESH_STAY:-}" ]; then
  echo "serving on http://$addr/v1 until Ctrl-C"
  wait $mesh
fi
