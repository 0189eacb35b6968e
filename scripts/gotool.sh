#!/usr/bin/env bash
# Builds a Go program the tests run for real, once per machine, from its Go
# module at a pinned version, into the pdmesh cache ($PDMESH_CACHE_DIR, else
# $XDG_CACHE_HOME/pdmesh, else ~/.cache/pdmesh), and prints the binary's
# path. Reused when present.
#
#   gotool.sh jaeger   Jaeger v1.75.0 (all-in-one: OTLP in, query API; its
#                      web UI's built files are not in the module). ~4 min.
#   gotool.sh consul   Consul v1.16.1, the last 1.16 release under MPL-2.0
#                      (1.16.2 on are under the BUSL, not to be used). ~3.5 min.
#   gotool.sh helm     Helm v4.3.2 (Apache-2.0): lints and renders
#                      infra/helm/pdmesh in the tests.
#
# `go install MODULE@VERSION` refuses both ("The go.mod file for the module
# providing named packages contains one or more replace directives"), so
# the module is downloaded, copied out of the read-only module cache and
# built in place. Consul's go.mod replaces its own submodules (api, sdk,
# ...) with folders its module zip does not carry: those replaces are
# dropped, so the versions its go.mod requires come from the proxy (all
# MPL-2.0 at those versions).
set -euo pipefail
tool=${1:?usage: gotool.sh jaeger|consul|helm}
case "$tool" in
  jaeger) module=github.com/jaegertracing/jaeger; version=v1.75.0; pkg=./cmd/jaeger ;;
  consul) module=github.com/hashicorp/consul; version=v1.16.1; pkg=. ;;
  helm) module=helm.sh/helm/v4; version=v4.3.2; pkg=./cmd/helm ;;
  *) echo "gotool.sh: unknown tool $tool (jaeger, consul or helm)" >&2; exit 2 ;;
esac
cache="${PDMESH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pdmesh}"
out="$cache/$tool-$version/$tool"
if [ -x "$out" ]; then echo "$out"; exit 0; fi
command -v go >/dev/null || { echo "gotool.sh: Go is needed to build $tool (this machine kind ships Go 1.26)" >&2; exit 1; }
mkdir -p "$cache"
# One build per tool at a time: a second caller (CI starts the builds early,
# in the background) waits for the first and takes its binary.
exec 9> "$cache/$tool.lock"
flock 9
if [ -x "$out" ]; then echo "$out"; exit 0; fi
work=$(mktemp -d "$cache/$tool-build.XXXXXX")
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
t0=$(date +%s)
echo "gotool.sh: building $tool $version (first time on this machine, a few minutes)" >&2
dir=$(go mod download -json "$module@$version" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
cp -r "$dir" "$work/src"
chmod -R u+w "$work/src"
if [ "$tool" = consul ]; then
  for m in api envoyextensions proto-public sdk troubleshoot; do
    (cd "$work/src" && go mod edit -dropreplace "$module/$m")
  done
fi
# Go lists every module it downloads: keep that in a log, shown on failure.
if ! (cd "$work/src" && GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w" -o "$work/$tool" "$pkg") > "$work/build.log" 2>&1; then
  tail -n 40 "$work/build.log" >&2
  echo "gotool.sh: building $tool $version failed" >&2
  exit 1
fi
mkdir -p "$(dirname "$out")"
mv "$work/$tool" "$out"
echo "gotool.sh: built $tool in $(( $(date +%s) - t0 )) s: $out" >&2
echo "$out"
