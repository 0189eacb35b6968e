#!/usr/bin/env bash
# The GPU check, one prepared run on a machine with an NVIDIA GPU, made to
# fit in this workplace's 15 minutes of device time (start included):
#
#   scripts/gpu-check.sh [OUT_DIR]        (default docs/benchmarks/gpu-check-<date>)
#
# What it brings (scripts/gpu-pack.sh packs it for a machine that can
# neither build nor download):
#   binaries   cargo builds them if it is there; else $PDMESH_BIN_DIR, with
#              the test binaries as test-gpu_kernels, test-cuda, test-referee
#   the model  $PDMESH_MODEL, else `pdmesh-engine fetch`
#   llama.cpp  $LLAMA_SRC: a trimmed source tree (or its .tar.xz); built for
#              this GPU in the background while pdmesh's checks run
#   NIXL       $PDMESH_NIXL_DIR: the nixl-cu12 wheel's libraries (the folder
#              holding .nixl_cu12.mesonpy.libs); without it KV goes over TCP
#   NVRTC      $PDMESH_NVRTC_LIB, else the pip wheel's, else the toolkit's;
#              cuBLAS from /usr/local/cuda/lib64 (the loader's path)
#
# Steps, each writing JSON under OUT_DIR (a step that cannot run says why):
#   1. llama.cpp's CUDA build starts in the background (llama-bench and
#      llama-batched-bench, niced, 12 of the cores).
#   2. tests.json: the CUDA tests (every kernel against the CPU; the GPU
#      engine against the CPU engine; the f32 referee; a traced step).
#   3. kv-vram.json: one prompt's KV (512 tokens) moved GPU to GPU between
#      two processes over NIXL, against a device-to-device copy, bytes checked.
#      status.json, mesh.json: a mesh on the GPU (prefill and decode on
#      CUDA), unique prompts at concurrency 64 and 96.
#   4. knob-rows.json, knob-gemm.json: the knob A/Bs at 64 and 96, two meshes
#      each, A, B, A, B: PDMESH_CUDA_ROWS_PER_CTA 4 against 8, and
#      PDMESH_CUDA_GEMM_MIN_ROWS 9 against 0 (the GEMM off).
#   5. bench-<r>.json, llama-bench-<r>.json, batched-<r>.txt: the engine
#      against llama.cpp's CUDA build, two rounds interleaved.
#   6. side-by-side.{json,md}: one table (scripts/gpu_side_by_side.py).
# Exits non-zero when a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/benchmarks/gpu-check-$(date +%F)}
out=$(mkdir -p "$out" && cd "$out" && pwd)
failed=0
log() { echo "gpu-check $(date +%T): $*" >&2; }
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

bin=${PDMESH_BIN_DIR:-target/release}
tests=$bin
if command -v cargo >/dev/null && [ -z "${PDMESH_BIN_DIR:-}" ]; then
  log "building (release)"
  cargo build --release --workspace --all-targets 2>&1 | tail -3
  tests=$work/tests && mkdir -p "$tests"
  for t in gpu_kernels cuda referee; do
    f=$(ls -t target/release/deps/$t-* 2>/dev/null | grep -v '\.d$' | head -1)
    [ -n "$f" ] && cp "$f" "$tests/test-$t"
  done
fi

# 1. llama.cpp, in the background.
llama_bin=""
if [ -n "${LLAMA_SRC:-}" ]; then
  src=$LLAMA_SRC
  if [ -f "$src" ]; then mkdir -p "$work/llama" && tar -xJf "$src" -C "$work/llama" && src=$work/llama; fi
  llama_bin=$src/build/bin
  log "building llama.cpp (CUDA) in the background"
  (cd "$src" && nice -n 19 cmake -S . -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF && nice -n 19 ninja -C build -j12 llama-bench llama-batched-bench) \
    >"$out/llama-build.log" 2>&1 &
  llama_pid=$!
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
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ -n "${PDMESH_NIXL_DIR:-}" ]; then
  export LD_LIBRARY_PATH=$PDMESH_NIXL_DIR/.nixl_cu12.mesonpy.libs:$LD_LIBRARY_PATH
fi
model=${PDMESH_MODEL:-$("$bin/pdmesh-engine" fetch 2>/dev/null | tail -1)}
export PDMESH_MODEL=$model

python3 - "$out/env.json" <<EOF
import json, subprocess, sys
def run(*a):
    try: return subprocess.run(a, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as e: return f"unavailable: {e}"
json.dump({"gpu": run("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"),
           "nvrtc": "$PDMESH_NVRTC_LIB", "nixl_dir": "${PDMESH_NIXL_DIR:-}", "llama_src": "${LLAMA_SRC:-}",
           "model": "$model", "bin_dir": "$bin", "cpus": run("nproc"),
           "commit": run("git", "rev-parse", "HEAD")}, open(sys.argv[1], "w"), indent=1)
EOF

# 2. The CUDA tests, one binary at a time; a skip (no GPU) is a failure here.
results=()
for t in gpu_kernels cuda referee; do
  exe=$tests/test-$t
  if [ ! -x "$exe" ]; then results+=("{\"test\":\"$t\",\"ran\":false,\"why\":\"no test binary $exe\"}"); failed=1; continue; fi
  log "tests: $t"
  o=$("$exe" --test-threads=1 --nocapture 2>&1); rc=$?
  echo "$o" >"$out/test-$t.log"
  echo "$o" | grep -E '^test |referee|SKIPPED' | tail -20 >&2
  skipped=$(echo "$o" | grep -c 'SKIPPED:' || true)
  summary=$(echo "$o" | grep '^test result' | tail -1 | sed 's/"/\\"/g')
  [ "$rc" -ne 0 ] || [ "$skipped" -gt 0 ] && failed=1
  results+=("{\"test\":\"$t\",\"ran\":true,\"rc\":$rc,\"skipped\":$skipped,\"summary\":\"$summary\"}")
done
(IFS=,; echo "[${results[*]}]") >"$out/tests.json"

# 3. NIXL from VRAM to VRAM, then meshes on the GPU (prefill and decode on CUDA).
log "KV transfer GPU to GPU over NIXL"
"$bin/pdmesh-bench" kv --vram --rounds 20 >"$out/kv-vram.json" 2>"$out/kv-vram.err" || {
  failed=1
  python3 -c "import json,sys; json.dump({'ran': False, 'why': open(sys.argv[1]).read()[-2000:]}, open(sys.argv[2],'w'))" \
    "$out/kv-vram.err" "$out/kv-vram.json"
}
mesh() { # mesh NAME PORT ENV=VALUE...
  local name=$1 port=$2
  shift 2
  env PDMESH_BACKEND=cuda "$@" "$bin/meshctl" up --gateway-addr "127.0.0.1:$port" \
    --registry-dir "$work/$name/registry" --model "$model" --prefill-nice 0 >"$work/$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 240); do
    grep -q "pdmesh is up" "$work/$name.log" && return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  log "mesh $name did not come up: $(tail -5 "$work/$name.log")"; return 1
}
stop_meshes() { pkill -f "meshctl up .*--registry-dir $work/" || true; sleep 2; }
lt() { "$bin/pdmesh-loadtest" --mode closed --concurrency 64,96 --requests 192 --max-tokens 64 --ignore-eos \
  --unique-prompts --seed 1 --timeout-s 60 "$@"; }
ab() { # ab OUT LABEL_A LABEL_B: meshes a (18280) and b (18281) are up
  lt --target 127.0.0.1:18280 --target-b 127.0.0.1:18281 --label-a "$2" --label-b "$3" --ab-rounds 2 \
    --out "$out/$1.json" --markdown "$out/$1.md" >/dev/null || failed=1
}
if mesh a 18280 PDMESH_CUDA_ROWS_PER_CTA=4 && mesh b 18281 PDMESH_CUDA_ROWS_PER_CTA=8; then
  # Where each worker runs, its knobs and where its KV arena is
  # (runtime.kv_arena: "vram (GPU 0)" when NIXL registered VRAM).
  "$bin/meshctl" status --registry-dir "$work/a/registry" --json >"$out/status.json" 2>&1 || true
  grep -h "KV transport\|NIXL\|nixl" "$work/a.log" | head -20 >"$out/transport.txt" 2>/dev/null || true
  log "mesh load at 64 and 96"
  lt --target 127.0.0.1:18280 --registry-dir "$work/a/registry" --meshctl "$bin/meshctl" --out "$out/mesh.json" \
    >/dev/null || failed=1
  log "knob A/B: rows per CTA 4 (A) against 8 (B)"
  ab knob-rows rows_per_cta_4 rows_per_cta_8
  stop_meshes
  if mesh a 18280 PDMESH_CUDA_GEMM_MIN_ROWS=9 && mesh b 18281 PDMESH_CUDA_GEMM_MIN_ROWS=0; then
    log "knob A/B: GEMM from 9 rows (A) against no GEMM (B)"
    ab knob-gemm gemm_min_rows_9 gemm_off
  else
    failed=1
  fi
  stop_meshes
else
  failed=1
  echo '{"ran": false, "why": "a mesh on the GPU did not come up; see the log lines gpu-check printed"}' >"$out/mesh.json"
  stop_meshes
fi

# 5. The engine against llama.cpp, interleaved: pdmesh, llama.cpp, pdmesh, llama.cpp.
if [ -n "$llama_bin" ]; then
  log "waiting for the llama.cpp build (up to ${LLAMA_WAIT_S:-420} s)"
  for _ in $(seq 1 "${LLAMA_WAIT_S:-420}"); do kill -0 "$llama_pid" 2>/dev/null || break; sleep 1; done
  [ -x "$llama_bin/llama-bench" ] || { log "llama.cpp did not build: $(tail -3 "$out/llama-build.log")"; llama_bin=""; failed=1; }
fi
for r in 1 2; do
  log "engine bench on CUDA, round $r"
  if ! "$bin/pdmesh-engine" bench --backend cuda --model "$model" --prefill-tokens 512 --batches 1,8,32,64 --steps 64 \
    >"$out/bench-$r.json" 2>"$out/bench-$r.err"; then
    failed=1
    python3 -c "import json,sys; json.dump({'ran': False, 'why': open(sys.argv[1]).read()[-2000:]}, open(sys.argv[2],'w'))" \
      "$out/bench-$r.err" "$out/bench-$r.json"
  fi
  if [ -n "$llama_bin" ]; then
    log "llama.cpp benches, round $r"
    "$llama_bin/llama-bench" -m "$model" -ngl 99 -p 512 -n 128 -o json >"$out/llama-bench-$r.json" 2>>"$out/llama-run.log" || failed=1
    "$llama_bin/llama-batched-bench" -m "$model" -ngl 99 -c 16384 -npp 128 -ntg 64 -npl 1,8,32,64 \
      >"$out/batched-$r.txt" 2>>"$out/llama-run.log" || failed=1
  fi
done

# 6. One table.
python3 scripts/gpu_side_by_side.py "$out" || failed=1
log "results in $out (failed=$failed)"
exit $failed
