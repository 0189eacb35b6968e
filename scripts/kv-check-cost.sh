#!/usr/bin/env bash
# What the KV checksums cost a request, measured in a real mesh: one
# prefill, one decode, a local Jaeger; N greedy requests with a prompt of
# about TOKENS tokens, one at a time, over TRANSPORT (nixl or tcp). From each
# request's trace: the prefill's write (kv_transfer: kv.write_ms), the
# decode's check on the request's path (kv_verify: kv.verify_ms) and, over
# NIXL, the checksums taken when the write landed (kv.verified_on_landing_ms,
# off the path). Prints one JSON line per request and a summary with medians
# and the check's share of the write.
#
#   bash scripts/kv-check-cost.sh [TRANSPORT] [N] [TOKENS]
set -euo pipefail
cd "$(dirname "$0")/.."
transport=${1:-nixl}
n=${2:-10}
tokens=${3:-512}
state=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
jaeger=$(bash scripts/gotool.sh jaeger)
cargo build --release --workspace --bins >&2
./target/release/meshctl up --gateway-addr 127.0.0.1:$port --registry-dir "$state/registry" --kv-transport "$transport" \
  --max-local-prefill 0 --jaeger --jaeger-bin "$jaeger" > "$state/up.out" 2>"$state/up.err" &
mesh=$!
trap 'kill -TERM $mesh 2>/dev/null; wait $mesh 2>/dev/null; rm -rf "$state"' EXIT
until grep -q "pdmesh is up" "$state/up.out" 2>/dev/null; do
  kill -0 $mesh 2>/dev/null || { cat "$state/up.err" >&2; exit 1; }
  sleep 0.5
done
python3 - "$state/up.out" "$transport" "$n" "$tokens" <<'PY'
import json, re, statistics, sys, time, urllib.request
up, transport, n, tokens = open(sys.argv[1]).read(), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
gateway = re.search(r"pdmesh is up: (http://[^ ]+)/v1", up).group(1)
ui = re.search(r"^traces: (http[^ ]*)", up, re.M).group(1).rstrip("/")

def ask(i):
    words = " ".join(f"w{i}x{k}" for k in range(tokens // 3))  # ~3 tokens a word: unique, no prefix reuse
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": words}], "max_tokens": 2, "temperature": 0}
    req = urllib.request.Request(gateway + "/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.headers["x-pdmesh-trace-id"], json.load(r)["usage"]["prompt_tokens"]

def spans(trace_id):
    for _ in range(100):
        try:
            with urllib.request.urlopen(f"{ui}/api/traces/{trace_id}", timeout=10) as r:
                data = json.load(r)["data"]
            s = [x for t in data for x in t["spans"]]
            if any(x["operationName"] == "kv_verify" for x in s) and any(x["operationName"] == "kv_transfer" for x in s):
                return s
        except Exception:
            pass
        time.sleep(0.2)
    raise SystemExit(f"trace {trace_id} incomplete in Jaeger")

def tag(span, key):
    return next((t["value"] for t in span["tags"] if t["key"] == key), None)

rows = []
for i in range(n):
    tid, prompt = ask(i)
    s = spans(tid)
    xfer = next(x for x in s if x["operationName"] == "kv_transfer")
    verify = next(x for x in s if x["operationName"] == "kv_verify")
    row = {"request": i, "prompt_tokens": prompt, "transport": tag(xfer, "kv.transport"), "blocks": tag(verify, "kv.verified_blocks"),
           "write_ms": tag(xfer, "kv.write_ms"), "check_on_path_ms": tag(verify, "kv.verify_ms"),
           "checksums_on_landing_ms": tag(verify, "kv.verified_on_landing_ms")}
    rows.append(row)
    print(json.dumps(row))
med = lambda k: statistics.median([r[k] for r in rows if r[k] is not None]) if any(r[k] is not None for r in rows) else None
w, c = med("write_ms"), med("check_on_path_ms")
print(json.dumps({"transport": transport, "requests": n, "median_write_ms": w, "median_check_on_path_ms": c,
                  "check_share_of_write": c / w if w else None, "median_checksums_on_landing_ms": med("checksums_on_landing_ms"),
                  "landed_before_done": sum(r["checksums_on_landing_ms"] is not None for r in rows)}))
PY
