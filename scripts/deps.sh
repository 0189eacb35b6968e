#!/usr/bin/env bash
# What building and running pdmesh needs beyond Rust and Python with pip,
# installed if missing: libclang (bindgen inside nixl-sys) and the NIXL
# wheel (libnixl_capi.so + UCX; without it the workers fall back to TCP).
set -euo pipefail
if ! dpkg -s libclang-dev >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -q && $sudo apt-get install -y -q libclang-dev
fi
python3 -m pip install --quiet --disable-pip-version-check nixl-cu12==1.5.1 "$@"
