#!/usr/bin/env bash
# What building and running pdmesh needs beyond Rust and Python with pip,
# installed if missing: libclang (bindgen inside nixl-sys) and the NIXL
# wheel (libnixl_capi.so + UCX; without it the workers fall back to TCP).
# Usage: deps.sh [--apt DEBIAN_PACKAGE]... [PIP_PACKAGE]...
set -euo pipefail
apt_pkgs=(libclang-dev)
pip_pkgs=(nixl-cu12==1.5.1)
while [ $# -gt 0 ]; do
  case "$1" in
    --apt) apt_pkgs+=("$2"); shift 2 ;;
    *) pip_pkgs+=("$1"); shift ;;
  esac
done
missing=()
for p in "${apt_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
python3 -m pip install --quiet --disable-pip-version-check "${pip_pkgs[@]}"
