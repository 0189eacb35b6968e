#!/usr/bin/env bash
# Pack what scripts/gpu-check.sh needs for a GPU machine that can neither
# build nor download (this workplace's device machine: no Rust, no network,
# 64 MiB per call, of which the repository itself takes about 31): the
# release binaries and the two CUDA test binaries under stable names, and
# the model, xz-compressed and cut into pieces that each fit one call.
#
#   scripts/gpu-pack.sh            # writes .gpu/ (ignored by git); lists the pieces
#
# Then, on the GPU machine, one call per piece, back to back (a warm
# machine keeps /tmp between calls), each carrying only its piece:
#   .gpu/bins.tar.xz:      mkdir -p /tmp/g && tar -xJf .gpu/bins.tar.xz -C /tmp/g
#   each .gpu/model.xz.*:  mkdir -p /tmp/g && cp .gpu/model.xz.* /tmp/g/
#   the last one, then:    cat /tmp/g/model.xz.* | xz -d >/tmp/g/model.gguf &&
#                          (cd /tmp/g && sha256sum -c $PWD/.gpu/model.sha256) &&
#                          PDMESH_BIN_DIR=/tmp/g PDMESH_MODEL=/tmp/g/model.gguf scripts/gpu-check.sh $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
cargo build --release --workspace --all-targets
rm -rf .gpu && mkdir -p .gpu/stage
for b in meshctl pdmesh-engine pdmesh-prefill pdmesh-decode pdmesh-router pdmesh-gateway pdmesh-tokenizer pdmesh-kvbroker pdmesh-loadtest; do
  cp "target/release/$b" .gpu/stage/
done
for t in gpu_kernels cuda; do
  cp "$(ls -t target/release/deps/$t-* | grep -v '\.d$' | head -1)" ".gpu/stage/test-$t"
done
tar -cJf .gpu/bins.tar.xz -C .gpu/stage .
rm -rf .gpu/stage
model=$(target/release/pdmesh-engine fetch | tail -1)
xz -T0 -6 -c "$model" | split -b 32M -d - .gpu/model.xz.
(cd "$(dirname "$model")" && sha256sum "$(basename "$model")") | sed 's/ .*/  model.gguf/' >.gpu/model.sha256
ls -la .gpu
