#!/usr/bin/env bash
# The project's test command (README, CI): fetch the model once, then run
# every test in the one build profile the project uses (release).
set -euo pipefail
cd "$(dirname "$0")/.."
# libclang, the NIXL wheel (the tests expect NIXL to load), the official
# OpenAI client (the gateway's client test) and Prometheus (it scrapes a
# mesh in a test), if missing.
bash scripts/deps.sh --apt prometheus openai==3.57.0
cargo build --release --workspace --all-targets
./target/release/pdmesh-engine fetch
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --release --workspace 2>&1 | tee "$log"
# One closing line for the whole run (cargo prints one per test binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "%d passed, %d failed\n", p, f }' "$log"
