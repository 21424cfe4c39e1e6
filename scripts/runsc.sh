#!/usr/bin/env bash
# Builds gVisor's runsc (the runtime of the gvisor isolation level) at the version pinned in
# tools/runsc/go.mod, static (CGO_ENABLED=0: a cgo runsc fails at sandbox start), into a cache
# directory keyed by that version outside the repository, and prints its path. A cached build is
# reused. The broker finds it there (or takes broker --runsc PATH).
set -euo pipefail
cd "$(dirname "$0")/../tools/runsc"
version=$(go list -m -f '{{.Version}}' gvisor.dev/gvisor)
dir="${XDG_CACHE_HOME:-$HOME/.cache}/sbx-broker/runsc-$version"
bin="$dir/runsc"
if [ ! -x "$bin" ]; then
  mkdir -p "$dir"
  echo "building runsc $version (static, a few minutes the first time) into $dir ..." >&2
  tmp="$dir/runsc.tmp.$$"
  trap 'rm -f "$tmp"' EXIT
  CGO_ENABLED=0 go build -trimpath -o "$tmp" gvisor.dev/gvisor/runsc
  mv "$tmp" "$bin"
fi
echo "$bin"
