#!/usr/bin/env bash
# The project's test command (README, CI): fetch the model once, then run
# every test in the one build profile the project uses (release).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --workspace --all-targets
./target/release/pdmesh-engine fetch
cargo test --release --workspace
