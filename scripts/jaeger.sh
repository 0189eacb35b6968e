#!/usr/bin/env bash
# Builds Jaeger (all-in-one: OTLP in on 4317/4318, query API and UI on
# 16686) from its Go module at the pinned version, once per machine, into
# the pdmesh cache ($PDMESH_CACHE_DIR, else $XDG_CACHE_HOME/pdmesh, else
# ~/.cache/pdmesh), and prints the binary's path. Reused when present.
#
# `go install github.com/jaegertracing/jaeger/cmd/jaeger@VERSION` is refused
# ("The go.mod file for the module providing named packages contains one or
# more replace directives"), so the module is downloaded, copied out of the
# read-only module cache and built in place. The first build takes about
# 3.5 minutes on 2 cores and gives a ~120 MB binary.
# Usage: jaeger.sh            -> prints the path of the binary
set -euo pipefail
version=v1.75.0
cache="${PDMESH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pdmesh}"
out="$cache/jaeger-$version/jaeger"
if [ -x "$out" ]; then echo "$out"; exit 0; fi
command -v go >/dev/null || { echo "jaeger.sh: Go is needed to build Jaeger (this machine kind ships Go 1.26)" >&2; exit 1; }
mkdir -p "$cache"
work=$(mktemp -d "$cache/jaeger-build.XXXXXX")
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
t0=$(date +%s)
echo "jaeger.sh: building Jaeger $version (first time on this machine, ~3.5 min)" >&2
dir=$(go mod download -json "github.com/jaegertracing/jaeger@$version" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
cp -r "$dir" "$work/src"
chmod -R u+w "$work/src"
# Go lists every module it downloads: keep that in a log, shown on failure.
if ! (cd "$work/src" && GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w" -o "$work/jaeger" ./cmd/jaeger) > "$work/build.log" 2>&1; then
  tail -n 40 "$work/build.log" >&2
  echo "jaeger.sh: building Jaeger $version failed" >&2
  exit 1
fi
mkdir -p "$(dirname "$out")"
mv "$work/jaeger" "$out"
echo "jaeger.sh: built in $(( $(date +%s) - t0 )) s: $out" >&2
echo "$out"
