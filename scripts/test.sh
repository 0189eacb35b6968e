#!/usr/bin/env bash
# The project's test command (README, CI): fetch the model once, then run
# every test in the one build profile the project uses (release).
set -euo pipefail
cd "$(dirname "$0")/.."
# libclang, the NIXL wheel (the tests expect NIXL to load), the official
# OpenAI client (the gateway's client test), Prometheus (it scrapes a mesh
# in a test), kubernetes-validate (infra/k8s checked offline) and NVRTC
# (the CUDA kernels compiled to PTX), if missing.
bash scripts/deps.sh --apt prometheus openai==3.57.0 kubernetes-validate==1.37.0 nvidia-cuda-nvrtc-cu12==12.8.93
# NVRTC from that wheel compiles every CUDA kernel (no GPU or driver needed);
# here a missing NVRTC fails the kernel test instead of skipping it.
PDMESH_NVRTC_LIB="$(python3 -c 'import os, nvidia.cuda_nvrtc as m; print(os.path.join(list(m.__path__)[0], "lib", "libnvrtc.so.12"))')"
export PDMESH_NVRTC_LIB PDMESH_REQUIRE_NVRTC=1
# Jaeger, Consul and Helm, built once per machine from their Go modules
# into the pdmesh cache (about 4, 3.5 and 4.7 min the first time): the
# tracing test reads traces back from the real Jaeger, the discovery test
# runs on a real agent, and Helm lints and renders infra/helm/pdmesh.
PDMESH_JAEGER_BIN="$(bash scripts/gotool.sh jaeger)"
PDMESH_CONSUL_BIN="$(bash scripts/gotool.sh consul)"
PDMESH_HELM_BIN="$(bash scripts/gotool.sh helm)"
export PDMESH_JAEGER_BIN PDMESH_REQUIRE_JAEGER=1 PDMESH_CONSUL_BIN PDMESH_REQUIRE_CONSUL=1
export PDMESH_HELM_BIN PDMESH_REQUIRE_HELM=1
cargo build --release --workspace --all-targets
./target/release/pdmesh-engine fetch
./target/release/pdmesh-engine fetch gemma3-270m
log=$(mktemp)
# Tests that cannot run here (no namespaces, no GPU) write why to this file
# (pdmesh_testkit::skip); they are counted as skipped, not passed.
PDMESH_SKIPPED=$(mktemp)
export PDMESH_SKIPPED
trap 'rm -f "$log" "$PDMESH_SKIPPED"' EXIT
cargo test --release --workspace 2>&1 | tee "$log"
skipped=$(wc -l < "$PDMESH_SKIPPED")
if [ "$skipped" -gt 0 ]; then echo "skipped (could not run here):"; sed 's/^/  /' "$PDMESH_SKIPPED"; fi
# One closing line for the whole run (cargo prints one per test binary).
awk -v s="$skipped" '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "%d passed, %d failed, %d skipped\n", p - s, f, s }' "$log"
