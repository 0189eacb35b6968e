#!/usr/bin/env bash
# The prefix cache, measured side by side (pdmesh-loadtest A/B: A, B, A, B
# ... at each load point, one invocation per workload):
#
#   1. agentic sessions          pdmesh (cache on)  vs llama-server
#   2. shared system prompt      pdmesh (cache on)  vs llama-server
#   3. one repeated prompt, c=1  pdmesh (cache on)  vs llama-server
#   4. unique prompts (sweep)    pdmesh (cache on)  vs llama-server
#   5. unique prompts (sweep)    pdmesh (cache on)  vs pdmesh (cache off)
#   6. agentic, 2 prefill workers: cache-aware vs least-busy routing
#   7. agentic: decode cache with answers vs prompts only (--decode-prefix-cache-generated false)
#   8. agentic: local prefill vs none (--max-local-prefill 0)
#   9. unique prompts (sweep): local prefill vs none
#  10. unique prompts (sweep): local prefill slices of 256 vs 64 tokens a step
#  11. long unique prompts (~440 tokens, so prefill workers run them beside
#      decode): prefill at nice 0 vs nice 10 (--prefill-nice)
#  12. long unique prompts: shared cores vs prefill on CPU 0 and decode on CPU 1
#  13. long unique prompts: kernel pools spinning ~3 ms before parking vs
#      parking at once (PDMESH_POOL_SPIN_ITERS=0)
#  14. long unique prompts: through the prefill worker (--max-local-prefill
#      256, the default) vs prefilled by the decode worker (1024)
#  15. unique prompts (sweep): the CPU's best kernels (AVX-512 VNNI where
#      present) vs the AVX2 kernels (PDMESH_KERNELS=avx2)
#
#   scripts/bench_prefix_cache.sh /path/to/llama-server [ROUNDS] [WHICH]
#
# WHICH is a comma list of the workload numbers above (default all);
# LEVELS=1,4,16,32 sets the sweep's concurrency levels and TAG=name adds
# -name to the output files; PLOTS=1 adds the loadtest's plots (SVG, PNG).
# Writes docs/benchmarks/prefix-cache-<date>-<n>[-$TAG].{json,md}. Build
# llama-server outside this repository (../shared/BENCHMARKS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
llama=${1:?path of llama-server}
rounds=${2:-2}
which=${3:-1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}
levels=${LEVELS:-1,4,16,32}
tag=${TAG:+-$TAG}
bin=target/release
day=$(date +%F)
out=docs/benchmarks
model=$("$bin/pdmesh-engine" fetch 2>/dev/null | tail -1)
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

# A mesh named $1 on gateway port $2, with `meshctl up` flags after them.
mesh() {
  local name=$1 port=$2
  shift 2
  "$bin/meshctl" up --gateway-addr "127.0.0.1:$port" --registry-dir "$work/$name/registry" "$@" >"$work/$name.log" 2>&1 &
  for _ in $(seq 1 600); do grep -q "pdmesh is up" "$work/$name.log" && return; sleep 0.5; done
  echo "mesh $name did not come up" >&2; exit 1
}
stop_meshes() { pkill -f "meshctl up .*--registry-dir $work/" || true; sleep 2; }
llama_up() {
  # 32 slots of 1024 positions; prompt caching is llama-server's default.
  "$llama" -m "$model" --host 127.0.0.1 --port 18181 -t 2 -np 32 -cb -c 32768 >"$work/llama.log" 2>&1 &
  for _ in $(seq 1 600); do curl -sf http://127.0.0.1:18181/health >/dev/null && return; sleep 0.5; done
}
want() { [[ ",$which," == *",$1,"* ]]; }
lt() { # lt N LABEL_B TARGET_B REGISTRY ARGS...
  local n=$1 label_b=$2 target_b=$3 reg=$4
  shift 4
  "$bin/pdmesh-loadtest" --target 127.0.0.1:18180 --target-b "$target_b" --label-a pdmesh --label-b "$label_b" \
    --ab-rounds "$rounds" --registry-dir "$work/$reg/registry" --meshctl "$bin/meshctl" --seed 1 "$@" \
    --out "$out/prefix-cache-$day-$n$tag.json" --markdown "$out/prefix-cache-$day-$n$tag.md" \
    ${PLOTS:+--plots "$out/prefix-cache-$day-$n$tag"}
}

set -x
if want 1 || want 2 || want 3 || want 4; then
  mesh on 18180
  llama_up
  want 1 && lt 1 llama-server 127.0.0.1:18181 on --mode agentic --sessions 8 --rounds 3 --think-s 1 --max-tokens 48 --ignore-eos
  want 2 && lt 2 llama-server 127.0.0.1:18181 on --mode closed --concurrency 1,4,16 --requests 32 --max-tokens 32 \
    --ignore-eos --system-prompt-tokens 400
  want 3 && lt 3 llama-server 127.0.0.1:18181 on --mode closed --concurrency 1 --requests 16 --max-tokens 16 \
    --ignore-eos --repeat-prompt --system-prompt-tokens 100
  want 4 && lt 4 llama-server 127.0.0.1:18181 on --mode closed --concurrency "$levels" --requests 32 --max-tokens 64 \
    --ignore-eos --unique-prompts
  pkill -f -- "--port 18181" || true
  stop_meshes
fi
if want 5; then
  mesh on 18180
  mesh off 18182 --prefix-cache-blocks 0 --router-policy least-busy
  lt 5 pdmesh-cache-off 127.0.0.1:18182 on --mode closed --concurrency "$levels" --requests 32 --max-tokens 64 \
    --ignore-eos --unique-prompts
  stop_meshes
fi
if want 6; then
  mesh aware 18180 --prefill-replicas 2
  mesh leastbusy 18183 --prefill-replicas 2 --router-policy least-busy
  lt 6 least-busy 127.0.0.1:18183 aware --mode agentic --sessions 8 --rounds 4 --think-s 1 --max-tokens 48 --ignore-eos
  stop_meshes
fi
agentic=(--mode agentic --sessions 8 --rounds 3 --think-s 1 --max-tokens 48 --ignore-eos)
long=(--mode closed --concurrency "$levels" --requests 32 --max-tokens 64 --ignore-eos --unique-prompts --system-prompt-tokens 400)
if want 7; then
  mesh on 18180
  mesh prompts 18184 --decode-prefix-cache-generated false
  lt 7 prompts-only 127.0.0.1:18184 on "${agentic[@]}"
  stop_meshes
fi
if want 8 || want 9; then
  mesh on 18180
  mesh remote 18185 --max-local-prefill 0
  want 8 && lt 8 no-local 127.0.0.1:18185 on "${agentic[@]}"
  want 9 && lt 9 no-local 127.0.0.1:18185 on --mode closed --concurrency "$levels" --requests 32 --max-tokens 64 \
    --ignore-eos --unique-prompts
  stop_meshes
fi
if want 10; then
  mesh on 18180
  mesh slices64 18186 --decode-local-step-tokens 64
  lt 10 slices-64 127.0.0.1:18186 on --mode closed --concurrency "$levels" --requests 32 --max-tokens 64 \
    --ignore-eos --unique-prompts
  stop_meshes
fi
if want 11; then
  mesh on 18180 --prefill-nice 0
  mesh nice10 18187 --prefill-nice 10
  lt 11 prefill-nice-10 127.0.0.1:18187 on "${long[@]}"
  stop_meshes
fi
if want 12; then
  mesh on 18180
  mesh split 18188 --prefill-cpus 0 --decode-cpus 1
  lt 12 cpu-split 127.0.0.1:18188 on "${long[@]}"
  stop_meshes
fi
if want 13; then
  mesh on 18180
  PDMESH_POOL_SPIN_ITERS=0 mesh nospin 18189
  lt 13 no-spin 127.0.0.1:18189 on "${long[@]}"
  stop_meshes
fi
if want 14; then
  mesh on 18180
  mesh local1024 18190 --max-local-prefill 1024
  lt 14 local-1024 127.0.0.1:18190 on "${long[@]}"
  stop_meshes
fi
if want 15; then
  mesh on 18180
  PDMESH_KERNELS=avx2 mesh avx2 18191
  lt 15 avx2-kernels 127.0.0.1:18191 on --mode closed --concurrency "$levels" --requests 32 --max-tokens 64 \
    --ignore-eos --unique-prompts
  stop_meshes
fi
# Raw per-request records are kept compressed (docs/benchmarks/README.md).
find "$out" -maxdepth 1 -name "*-$day*.json" -size +64k -exec xz -9f {} +
